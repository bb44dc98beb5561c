

# --- appended by kda-verify's tools/assemble_aiter_upstream.py (tools/aiter_shims/logger_compat.py) ---
# Upstream's flash_kda.py and chunk_delta_attn.py log with %-style arguments
# (``_LOGGER.info("... %s", x)``); the 2026-08 logger takes one message.  Each level now passes
# the arguments on to Python's logging, which formats them only when the level is enabled.
for _level in ("debug", "info", "warning", "error", "critical"):
    setattr(AiterTritonLogger, _level,
            (lambda name: lambda self, msg, *args: getattr(self._logger, name)(msg, *args))(_level))
del _level
