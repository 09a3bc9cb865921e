"""The host AdamW kernel (host_adam.c): built with the machine's C compiler on first use, cached,
called through ctypes.

Why C: the update is bound by host memory bandwidth, and torch's CPU ops need several passes
(convert the bf16 gradient, scale it, update, write the working copy); one fused pass moves ~40%
fewer bytes. ctypes drops the GIL for the call, so the engine's thread runs on meanwhile (a
``torch.compile``d CPU kernel holds it). Where no compiler works, :func:`load` returns ``None``
and the optimizer keeps its torch path; ``TANDEM_HOST_KERNEL=torch`` forces that path. Its knobs
are the settings' ``host_adam`` section (:class:`~tandem.shared.infra.config.HostAdamSettings`),
read from their ``TANDEM_*`` variables when the kernel is first loaded.

    kernel = load()
    if kernel:
        kernel.adamw(master, exp_avg, exp_avg_sq, grad, work, hyper, write_state=True, write_work=True)

A compact state (bf16 masters, int8 moments: state_format.py) takes ``adamw_compact``, which is
``state_format.adamw_reference`` bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tandem.shared.infra.config import HostAdamSettings, from_env
from tandem.shared.train.state_format import BLOCK

log = logging.getLogger("tandem.train")

SOURCE = Path(__file__).with_name("host_adam.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
GRAD_BF16, WORK_BF16, WRITE_STATE, WRITE_WORK = 1, 2, 4, 8
# tandem_adamw_compact's flags
C_GRAD_BF16, C_MASTER_BF16, C_KAHAN, C_MOMENTS_INT8, C_WORK, C_WORK_BF16 = 1, 2, 4, 8, 16, 32
C_WRITE_MASTER, C_WRITE_MOMENTS, C_WRITE_WORK = 64, 128, 256


def _cpu_signature() -> str:
    """What ``-march=native`` depends on, so a cache shared between machines never loads a
    library built for another CPU."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _cache_dir(settings: HostAdamSettings) -> Path:
    base = settings.kernel_cache or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


class HostAdamKernel:
    def __init__(self, library: ctypes.CDLL, threads: int = 0) -> None:
        self._fn = library.tandem_adamw
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.c_int,
                                                     ctypes.c_int]
        # 0: one core stays with the engine's thread; TANDEM_ADAM_THREADS overrides (measuring contention)
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) - 1)
        self._compact = library.tandem_adamw_compact
        self._compact.restype = None
        self._compact.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_int64,
                                                          ctypes.POINTER(ctypes.c_float), ctypes.c_uint32,
                                                          ctypes.c_int, ctypes.c_int]
        self._bench = library.tandem_membench
        self._bench.restype = ctypes.c_uint32
        self._bench.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_uint32]

    def membench(self, op: str, dst: torch.Tensor, src: torch.Tensor) -> int:
        """One pass of ``op`` ("read" ``src``, "write" ``dst``, "copy" ``src`` into ``dst``; 4-byte
        contiguous tensors of one length) on the optimizer's threads, with its loads and stores."""
        if dst.numel() != src.numel() or dst.element_size() != 4 or src.element_size() != 4:
            raise ValueError("membench needs two 4-byte tensors of one length")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("membench needs contiguous tensors")
        code = {"read": 0, "write": 1, "copy": 2}[op]
        return int(self._bench(code, dst.data_ptr(), src.data_ptr(), dst.numel(), self.threads, 0))

    def adamw(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
              work: torch.Tensor, hyper: tuple[float, ...], write_state: bool, write_work: bool) -> None:
        """One pass over equal-length contiguous 1-D tensors (fp32 state, bf16/fp32 grad and work);
        ``hyper`` as host_adam.c's ``tandem_adamw`` documents it."""
        n = master.numel()
        for t in (exp_avg, exp_avg_sq, grad, work):
            if t.numel() != n or not t.is_contiguous():
                raise ValueError("host AdamW needs contiguous tensors of one length")
        for t in (master, exp_avg, exp_avg_sq):
            if t.dtype != torch.float32:
                raise ValueError("host AdamW state must be fp32")
        flags = (GRAD_BF16 if grad.dtype == torch.bfloat16 else 0) | (WORK_BF16 if work.dtype == torch.bfloat16 else 0)
        flags |= (WRITE_STATE if write_state else 0) | (WRITE_WORK if write_work else 0)
        values = (ctypes.c_float * 8)(*hyper)
        self._fn(master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), work.data_ptr(), n,
                 values, flags, self.threads)

    def adamw_compact(self, master: torch.Tensor, comp: torch.Tensor | None, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, m_absmax: torch.Tensor | None, v_absmax: torch.Tensor | None,
                      grad: torch.Tensor, work: torch.Tensor | None, hyper: tuple[float, ...], seed: int,
                      index_base: int, write_master: bool, write_moments: bool, write_work: bool) -> None:
        """One decay range's update of a compact state (state_format.py), in place: the arguments are
        ``state_format.adamw_reference``'s, and so is every bit of the result."""
        n = master.numel()
        quantized = m_absmax is not None
        blocks = -(-n // BLOCK)
        for t in (master, comp, exp_avg, exp_avg_sq, grad, work):
            if t is not None and (t.numel() != n or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError("compact host AdamW needs contiguous host tensors of one length")
        if master.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("compact host AdamW's master must be fp32 or bf16")
        if comp is not None and (master.dtype != torch.bfloat16 or comp.dtype != torch.bfloat16):
            raise ValueError("a Kahan compensation is bf16, beside a bf16 master")
        if (v_absmax is not None) != quantized:
            raise ValueError("int8 moments need both absmax arrays, fp32 moments neither")
        want = (torch.int8, torch.uint8) if quantized else (torch.float32, torch.float32)
        if (exp_avg.dtype, exp_avg_sq.dtype) != want:
            raise ValueError(f"compact host AdamW's moments must be {want[0]} and {want[1]}")
        for t in (m_absmax, v_absmax) if quantized else ():
            if t.dtype != torch.float32 or t.numel() != blocks or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"an absmax array must be {blocks} contiguous host fp32 values, one a block")
        for t in (grad, work):
            if t is not None and t.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError("compact host AdamW's grad and work must be fp32 or bf16")
        if len(hyper) != 8:
            raise ValueError("hyper must hold 8 values")
        flags = (C_GRAD_BF16 if grad.dtype == torch.bfloat16 else 0) | (C_KAHAN if comp is not None else 0)
        flags |= (C_MASTER_BF16 if master.dtype == torch.bfloat16 else 0) | (C_MOMENTS_INT8 if quantized else 0)
        if work is not None:
            flags |= C_WORK | (C_WORK_BF16 if work.dtype == torch.bfloat16 else 0)
        flags |= (C_WRITE_MASTER if write_master else 0) | (C_WRITE_MOMENTS if write_moments else 0)
        flags |= C_WRITE_WORK if write_work else 0
        values = (ctypes.c_float * 8)(*hyper)
        ptr = [None if t is None else t.data_ptr() for t in (comp, m_absmax, v_absmax, work)]
        self._compact(master.data_ptr(), ptr[0], exp_avg.data_ptr(), exp_avg_sq.data_ptr(), ptr[1], ptr[2],
                      grad.data_ptr(), ptr[3], n, index_base, values, seed & 0xFFFFFFFF, flags, self.threads)


def _build(settings: HostAdamSettings) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir(settings) / f"host_adam-{key}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True, capture_output=True,
                       text=True, timeout=120)
        partial.replace(target)  # atomic: processes building at once each get a whole library
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from None
    finally:
        partial.unlink(missing_ok=True)
    log.info("built the host AdamW kernel: %s", target)
    return target


@functools.cache
def load() -> HostAdamKernel | None:
    """The kernel, or ``None`` (torch fallback) where it cannot be built or is turned off."""
    settings = from_env("host_adam")
    if settings.host_kernel == "torch":
        return None
    try:
        return HostAdamKernel(ctypes.CDLL(str(_build(settings))), settings.adam_threads)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("host AdamW kernel unavailable, using torch's (slower): %s", exc)
        return None
