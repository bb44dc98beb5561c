

# --- appended by kda-verify's tools/assemble_aiter.py (tools/aiter_shims/chunk_delta_attn_utils_compat.py) ---
# The 2026-08 sibling modules of this package (gla_output, wy_fast, utils/cumsum) import
# chunk_delta_attn_autotune_configs, which the newer chunk_delta_attn_utils replaced by
# tuned_config_utils.autotune_configs("CHUNK_DELTA_ATTN", ...). Same rule: every candidate
# with CHUNK_DELTA_ATTN_TRITON_AUTOTUNE=1, else the default config (or the first) alone.
def chunk_delta_attn_autotune_configs(configs, default_config=None):
    from aiter.ops.triton.utils.tuned_config_utils import autotune_configs

    return autotune_configs("CHUNK_DELTA_ATTN", configs, default_config=default_config)
