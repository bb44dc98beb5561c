

# --- appended by kda-verify's tools/assemble_aiter.py (tools/aiter_shims/arch_info_compat.py) ---
# On a CUDA device Triton reports the target arch as an int (90 on an H200). The newest
# config_utils.resolve_config_dir asserts a string arch (it becomes a path component), which
# would fail the import of flash_kda on an NVIDIA GPU; an AMD arch is a string and stays as is.
if not isinstance(_CACHED_ARCH, str):
    _CACHED_ARCH = f"sm{_CACHED_ARCH}"
