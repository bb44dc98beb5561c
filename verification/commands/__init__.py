"""One module per `kda-verify` subcommand (NAME, HELP, add_arguments, run)."""
