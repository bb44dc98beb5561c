

# --- appended by kda-verify's tools/assemble_aiter_upstream.py (tools/aiter_shims/upstream_compat.py) ---
# Upstream's flash_kda.py (ROCm/aiter c1397349) calls tuned_config_utils.autotune_configs(op,
# configs, default_config=...), which the 2026-08 base lacks: the rule of the base's own
# chunk_delta_attn_autotune_configs, keyed on the op (every config when <op>_TRITON_AUTOTUNE is
# on, else the one default).
import os as _os


def autotune_configs(op, configs, default_config=None):
    if _os.getenv(f"{op}_TRITON_AUTOTUNE", "0").lower() in ("1", "true", "yes", "on"):
        return configs
    return [default_config if default_config is not None else configs[0]]
