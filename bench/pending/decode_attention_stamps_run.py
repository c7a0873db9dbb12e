"""Run bench/engine.py in a tree with `decode_attention_stamps.patch` applied (exp/stamp, beside this script), then
save the split kernels' and combines' timestamps to $OUT/LABEL/stamps.npz. Usage: python3 exp/stamp_run.py LABEL ENGINE_ARGS."""
import os
import sys
from pathlib import Path

import numpy as np

root = Path(__file__).resolve().parent / "stamp"
sys.path[:0] = [str(root), str(root / "bench")]
os.chdir(root)
import engine  # noqa: E402  (bench/engine.py)

from fp8lab.numba_kernels import splitkv_mma  # noqa: E402

out = Path(os.environ.get("OUT", "/tmp")) / sys.argv[1]
rc = engine.main(sys.argv[2:] + ["--out", str(out)])
ctas = max([1] + [seqs * kv * splits for _, seqs, kv, splits, _ in splitkv_mma.STAMP_META])
heads = max([1] + [seqs * h for _, seqs, _, _, h in splitkv_mma.STAMP_META])
# only the CTAs the launches used, compressed: the whole buffers (31 MB) are too large to come back from the device
np.savez_compressed(out / "stamps.npz", split=splitkv_mma.STAMP_BUFFER.copy_to_host()[:, :ctas],
                    combine=splitkv_mma.COMBINE_BUFFER.copy_to_host()[:, :heads], meta=np.array(splitkv_mma.STAMP_META))
print("stamps saved", len(splitkv_mma.STAMP_META), "launches, rc", rc)
