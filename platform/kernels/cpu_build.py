"""Build and load the fused CPU kernels (cpu_ops.c and cpu_a8.c, one library) for the host we run on.

At first use the C file is compiled with the system C compiler (`$CC`, else gcc, else cc) at
-O3 -march=native into `$SPLITSERVE_KERNEL_CACHE` (default ~/.cache/splitserve/kernels, or the
temporary folder where the home is read-only), under a
name that hashes the source, the compiler and the CPU's flags: a cache carried to another host
(an AVX2-only EPYC after an AMX Xeon) is never loaded there, it is rebuilt. The build takes about
a second (no torch headers) and is written to a temporary file and renamed, so concurrent workers
do not see a half-written library. Set SPLITSERVE_CPU_KERNELS=0 to never build or load it.

`load()` returns the ctypes library, or None, with one log line, when building or loading
fails: every caller keeps a pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

from splitserve.platform.quant.cpu import cpu_flags

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_ops.c")
SOURCES = tuple(pathlib.Path(__file__).with_name(f) for f in ("cpu_ops.c", "cpu_a8.c", "cpu_decode.c"))  # one library
ENV_DISABLE = "SPLITSERVE_CPU_KERNELS"
ENV_CACHE = "SPLITSERVE_KERNEL_CACHE"
ENV_AMX = "SPLITSERVE_AMX"  # 0: never use the AMX tiles (to compare; same bits either way)
_I64, _F32P, _I64P, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "ss_rms_norm": [_F32P, _F32P, _F32P, _I64, _I64, _F32, _INT],
    "ss_add_rms_norm": [_F32P, _F32P, _F32P, _F32P, _I64, _I64, _F32, _INT],
    "ss_rope_write_kv": [_F32P, _I64P, _F32P, _F32P, _F32P, _F32P, _I64P, _I64, _I64, _I64, _I64, _INT, _INT],
    "ss_decode_attention": [
        _F32P,
        _F32P,
        _F32P,
        _I64P,
        _I64P,
        _F32P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _F32,
        _INT,
        _INT,
    ],
    "ss_store_half": [_F32P, _F32P, _I64],
    "ss_silu_mul": [_F32P, _F32P, _I64, _I64, _INT],
    "ss_q4_linear": [_F32P, _I64, _I64, _F32P, _F32P, _F32P, _I64, _F32P, _INT],
    "ss_q4_dequant": [_F32P, _F32P, _F32P, _I64, _I64, _F32P, _INT],
    "ss_quantize_a8": [_F32P, _I64, _I64, _INT, _F32P, _F32P, _F32P, _INT],
    "ss_q4a8_linear": [_F32P, _F32P, _F32P, _I64, _I64, _INT, _F32P, _F32P, _F32P, _I64, _F32P, _INT],
    "ss_q8a8_linear": [_F32P, _F32P, _I64, _I64, _INT, _F32P, _F32P, _I64, _F32P, _INT],
    "ss_gemm_fixed": [_F32P, _I64, _I64, _F32P, _I64, _F32P, _INT, _INT],
}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> pathlib.Path:
    """$SPLITSERVE_KERNEL_CACHE, else ~/.cache/splitserve/kernels, else (a read-only home, as in
    the image's pods) the temporary folder."""
    if os.environ.get(ENV_CACHE):
        return pathlib.Path(os.environ[ENV_CACHE])
    home = pathlib.Path.home() / ".cache" / "splitserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / "splitserve-kernels"


def _build(cc: str, arch: tuple[str, ...] = ("-march=native",)) -> pathlib.Path:
    """The library for this host (`arch`: other instruction sets are built by the tests, to pin
    that every code path gives the same bits)."""
    source = b"".join(path.read_bytes() for path in SOURCES)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    host = " ".join(sorted(cpu_flags())) + " ".join(arch)
    key = hashlib.sha256(source + version.encode() + host.encode()).hexdigest()[:16]
    target = _cache_dir() / f"splitserve_cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        tmp_path = pathlib.Path(tmp.name)
    cmd = [cc, "-O3", *arch, "-fopenmp", "-fPIC", "-shared", "-o", str(tmp_path), *map(str, SOURCES), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-400:]}")
    os.replace(tmp_path, target)
    log.info("built the CPU kernels for this host: %s", target)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The fused CPU kernels for this host, or None (disabled, no compiler, or a failed build)."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        log.info("fused CPU kernels disabled by %s=0; using the torch path", ENV_DISABLE)
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (gcc/cc) found: the fused CPU kernels are off, using the torch path")
        return None
    try:
        lib = declare(ctypes.CDLL(str(_build(cc))))
    except (OSError, RuntimeError) as e:
        log.warning("the fused CPU kernels could not be built or loaded (%s); using the torch path", e)
        return None
    if os.environ.get(ENV_AMX, "1") == "0":
        lib.ss_a8_set_amx(0)
        log.info("AMX tiles disabled by %s=0; many-row steps take the VNNI path", ENV_AMX)
    return lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every kernel of `lib` its argument and result types."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.ss_a8_path.argtypes, lib.ss_a8_path.restype = [], ctypes.c_char_p
    lib.ss_a8_set_amx.argtypes, lib.ss_a8_set_amx.restype = [_INT], _INT
    lib.ss_decode_layers.argtypes = [_F32P, _I64, _F32P, _F32P, _I64] + [_F32P] * 9
    lib.ss_decode_layers.restype = ctypes.c_int
    lib.ss_lora_delta.argtypes = [_F32P, _I64, _I64, _F32P, _I64, _I64P, _I64, _F32P, _INT]
    lib.ss_lora_delta.restype = ctypes.c_int
    return lib
