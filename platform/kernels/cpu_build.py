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

Loading a library runs its code in the worker, so nothing is loaded that someone else could
have put there (the decode pod's sidecar once shared the worker's /tmp and UID, with HOME=/tmp).
Before loading, `open_verified` checks: the cache folder is a real folder (not a link), owned by
this process' user or root and writable by no group or other user; the library is a regular
file with the same owner rule and mode; and its sha256 equals the digest recorded next to it
(`<library>.sha256`) when it was built here. The ownership and mode checks keep other users out;
the digest catches a library changed after its build by anything that did not also rewrite the
digest (a half-copied cache, a file swapped in under an old name). The file is hashed and then
loaded through one open descriptor, so it cannot be swapped between the check and the load.

A check that fails is an error in the log saying what is wrong and what to fix, and the library
is not loaded. The worker then builds its own copy — over a library that changed, in a private
folder (mkdtemp, mode 700) when the folder itself is not trusted — because a vLLM user expects
the server to come up at its usual speed, not to fail or to run several times slower on the torch
path for a cache problem a second of compiling fixes. Only a build that fails falls back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import stat
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


class KernelRefused(Exception):
    """A kernel library or its folder failed a check before loading (the message says which)."""


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
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / "splitserve-kernels"


def _build(cc: str, arch: tuple[str, ...] = ("-march=native",), folder=None, force: bool = False) -> pathlib.Path:
    """The library for this host in `folder` (default: the cache folder), built unless there
    already (`force`: built again over it); its digest is recorded next to it. `arch`: other
    instruction sets are built by the tests, to pin that every code path gives the same bits."""
    source = b"".join(path.read_bytes() for path in SOURCES)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    host = " ".join(sorted(cpu_flags())) + " ".join(arch)
    key = hashlib.sha256(source + version.encode() + host.encode()).hexdigest()[:16]
    target = pathlib.Path(folder or _cache_dir()) / f"splitserve_cpu_ops-{key}.so"
    if target.exists() and not force:
        return target
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        tmp_path = pathlib.Path(tmp.name)
    cmd = [cc, "-O3", *arch, "-fopenmp", "-fPIC", "-shared", "-o", str(tmp_path), *map(str, SOURCES), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-400:]}")
    tmp_path.chmod(0o755)
    _write_atomically(_digest_path(target), hashlib.sha256(tmp_path.read_bytes()).hexdigest())
    os.replace(tmp_path, target)  # after its digest: a library visible here always has one
    log.info("built the CPU kernels for this host: %s", target)
    return target


def _digest_path(library: pathlib.Path) -> pathlib.Path:
    return library.with_name(library.name + ".sha256")


def _write_atomically(path: pathlib.Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)


def _check_owner_and_mode(path, st: os.stat_result, what: str) -> None:
    if st.st_uid not in (os.getuid(), 0):
        raise KernelRefused(
            f"the kernel {what} {path} belongs to uid {st.st_uid}, not to this process' user ({os.getuid()}) or root"
        )
    if st.st_mode & 0o022:
        raise KernelRefused(
            f"the kernel {what} {path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"`chmod go-w` it, or set {ENV_CACHE} to a folder only this user can write"
        )


def check_folder(folder: pathlib.Path) -> None:
    """KernelRefused unless `folder` is a real folder of this user (or root) that no one else may write."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise KernelRefused(f"the kernel folder {folder} is not a folder (a symbolic link?)")
    _check_owner_and_mode(folder, st, "folder")


def open_verified(library: pathlib.Path) -> ctypes.CDLL:
    """Load `library` after the checks of the module docstring; KernelRefused (nothing loaded) if one fails."""
    check_folder(library.parent)
    try:
        fd = os.open(library, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:  # ELOOP: a symbolic link in the library's place
        raise KernelRefused(f"the kernel library {library} does not open as a plain file: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KernelRefused(f"the kernel library {library} is not a regular file")
        _check_owner_and_mode(library, st, "library")
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        recorded_path = _digest_path(library)
        recorded = recorded_path.read_text().strip() if recorded_path.is_file() else None
        if recorded is not None:
            _check_owner_and_mode(recorded_path, os.lstat(recorded_path), "digest")
        if digest.hexdigest() != recorded:
            raise KernelRefused(
                f"the kernel library {library} has sha256 {digest.hexdigest()[:16]}..., not the digest "
                f"recorded when it was built here ({(recorded or 'none recorded')[:16]}): it changed after the build"
            )
        by_fd = f"/proc/self/fd/{fd}"  # the file just hashed, whatever the name points to now
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(library))
    finally:
        os.close(fd)


def _build_and_open(cc: str) -> ctypes.CDLL:
    """The library from a trusted folder: the cache folder, else a private one; one that fails its
    checks is rebuilt (see the module docstring for why not the torch path)."""
    folder = _cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_folder(folder)
    except KernelRefused as e:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="splitserve-kernels-"))
        log.error("refused the CPU kernel cache: %s; building a private copy in %s", e, folder)
    library = _build(cc, folder=folder)
    try:
        return open_verified(library)
    except KernelRefused as e:
        log.error("refused to load the CPU kernels: %s; building them again", e)
        return open_verified(_build(cc, folder=folder, force=True))


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
        lib = declare(_build_and_open(cc))
    except (OSError, RuntimeError, KernelRefused) as e:
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
