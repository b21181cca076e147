"""THC's C passes under ASan and UBSan: the one-pass encode (`_thc.encode`)
against the C passes over the whole bucket, at block sizes 8-2048 and odd
bucket sizes, with one scale and one a block, and its refusals of arguments
that do not fit (which must raise, not overrun). `_thc` takes the rank's own
tensors, not bytes from the network, so it has no fuzz target
(tests/test_fuzz_targets.py); this is its sanitized check. After `bash
scripts/fuzz` has built `build/fuzz/lib`:

    LD_PRELOAD=$(python3 -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so \\
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1 \\
    PYTHONMALLOC=malloc PYTHONPATH=. python3 bench/diag/asan_thc.py build/fuzz/lib
"""

from __future__ import annotations

import glob
import importlib.util
import sys
from typing import Any

import numpy as np
import torch

from dlcp.codecs import thc, thc_noise
from dlcp.codecs.base import CodecState


def _sanitized(lib: str) -> Any:
    so = glob.glob(f"{lib}/dlcp/codecs/_thc*.so")[0]
    spec = importlib.util.spec_from_file_location("dlcp.codecs._thc", so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cases(rng: np.random.Generator) -> int:
    n = 0
    for bits in (8, 4):
        for per in (8, 64, 1024, 2048):
            for numel in (1, per - 1, per, per + 1, 3 * per + 5):
                for scalar in (True, False):
                    fused, passes = thc.ThcCodec(bits), thc.ThcCodec(bits)
                    passes.fused = False
                    states = CodecState(), CodecState()
                    blocks = -(-numel // per)
                    for step in range(2):
                        x = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
                        sc: Any = 1.3
                        if not scalar:
                            sc = torch.from_numpy(rng.random(blocks).astype(np.float32))
                        got = [
                            c.encode(
                                x, per_packet=per, seed=2, scale=sc, state=st,
                                generator=torch.Generator().manual_seed(step),
                            )
                            for c, st in zip((fused, passes), states, strict=True)
                        ]  # fmt: skip
                        assert torch.equal(got[0].lanes, got[1].lanes)
                        assert torch.equal(got[0].block_max, got[1].block_max)
                        assert got[0].saturated == got[1].saturated
                        r0, r1 = states[0].residual, states[1].residual
                        assert r0 is not None and r1 is not None and torch.equal(r0, r1)
                        n += 1
    return n


def _refusals(mod: Any) -> int:
    f32, u8 = np.float32, np.uint8
    v, sg, sc, bm = np.ones(10, f32), np.ones(8, f32), np.ones(2, f32), np.empty(2, f32)
    bad = [
        (v, None, sg, sc, 1, 255, 8, np.empty(3, u8), None, bm),  # lanes too short
        (v, np.ones(9, f32), sg, sc, 1, 255, 8, np.empty(16, u8), None, bm),  # residual
        (v, None, sg, sc, 1, 255, 8, np.empty(16, u8), np.empty(11, f32), bm),  # residual_out
        (v, None, np.ones(6, f32), sc, 1, 255, 8, np.empty(16, u8), None, bm),  # not a block
        (v, None, sg, sc, 1, 15, 4, np.empty(7, u8), None, bm),  # 4-bit lanes too short
        (v, None, sg, np.ones(3, f32), 1, 255, 8, np.empty(16, u8), None, bm),  # scales
    ]
    for args in bad:
        try:
            mod.encode(*args)
        except ValueError:
            continue
        raise SystemExit(f"accepted {args}")
    return len(bad)


def main() -> int:
    mod = _sanitized(sys.argv[1] if len(sys.argv) > 1 else "build/fuzz/lib")
    thc._native_thc = thc_noise._native_thc = mod  # type: ignore[attr-defined]
    print(f"sanitized: {mod.__file__}")
    n = _cases(np.random.default_rng(0))
    print(f"ok: {n} encodes equal to the C passes, {_refusals(mod)} refusals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
