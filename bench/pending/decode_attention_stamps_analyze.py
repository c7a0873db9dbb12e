"""Timeline of the stamped split kernel and combine: the last decode step's layers, times in ns from the first CTA's
return from griddepcontrol.wait (the q/k/v GEMM's completion)."""
import sys

import numpy as np

z = np.load(sys.argv[1])
split, combine, meta = z["split"].astype(np.int64), z["combine"].astype(np.int64), z["meta"]
rows = []
for slot, seqs, kv, splits, heads in meta[-160:]:
    ctas = seqs * kv * splits
    s = split[slot, :ctas]
    if (s[..., 0] == 0).any():
        continue
    rows.append((s[:, :, 5, 0].max(), slot, seqs, kv, splits, heads))
rows.sort()
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 28
last = rows[-layers:]
print(f"{len(rows)} slots with data; the last {layers} by end time; splits {set(r[4] for r in last)}")
names = ["start", "waited", "input done", "tiles done", "merged", "end"]
acc = {k: [] for k in names + ["c start", "c waited", "c end", "next waited"]}
cyc = {k: [] for k in ["wait->input", "input->tiles", "tiles->merged", "merged->end"]}
last_by_shard, end_by_shard, input_by_shard = [], [], []  # per (sequence, kv head): which shard ends last
for i, (_, slot, seqs, kv, splits, heads) in enumerate(last):
    s = split[slot, :seqs * kv * splits]
    c = combine[slot, :seqs * heads]
    t0 = s[:, :, 1, 0].min()
    for k, name in enumerate(names):
        v = s[:, :, k, 0] - t0
        acc[name].append((np.median(v), v.max()))
    acc["c start"].append((np.median(c[:, 0, 0] - t0), c[:, 0, 0].max() - t0))
    acc["c waited"].append((np.median(c[:, 1, 0] - t0), c[:, 1, 0].max() - t0))
    acc["c end"].append((np.median(c[:, 2, 0] - t0), c[:, 2, 0].max() - t0))
    by_shard = s.reshape(seqs * kv, splits, 4, 6, 2)  # CTA (seq * kv + head) * splits + shard
    ends = by_shard[..., 5, 0].max(axis=2) - t0  # [seq * kv, shard], the latest warp
    last_by_shard.append(np.bincount(np.argmax(ends, axis=1), minlength=splits))
    end_by_shard.append(ends.mean(axis=0))
    input_by_shard.append((by_shard[..., 2, 0].max(axis=2) - t0).mean(axis=0))
    if i + 1 < len(last):
        nslot = last[i + 1][1]
        n = split[nslot, :seqs * kv * splits]
        acc["next waited"].append((n[:, :, 1, 0].min() - t0, 0))
    for k, name in enumerate(cyc):
        d = s[:, :, k + 2, 1] - s[:, :, k + 1, 1]
        cyc[name].append((np.median(d), d.max()))
print("stage (ns from the first CTA's wait return)  median over CTAs/warps | max; averaged over the layers")
for name, v in acc.items():
    if v:
        a = np.array(v, float)
        print(f"  {name:14s} {a[:, 0].mean():9.0f} | {a[:, 1].mean():9.0f}")
print("cycles within a warp: median | max")
for name, v in cyc.items():
    a = np.array(v, float)
    print(f"  {name:14s} {a[:, 0].mean():9.0f} | {a[:, 1].mean():9.0f}")
print("the shard whose CTA ends last, counted over (layer, sequence, kv head):", np.sum(last_by_shard, axis=0))
print("end by shard (ns, mean):", np.round(np.mean(end_by_shard, axis=0)))
print("input done by shard (ns, mean):", np.round(np.mean(input_by_shard, axis=0)))
# globaltimer resolution check
g = np.diff(np.unique(split[last[-1][1], :, :, :, 0].ravel()))
print("smallest globaltimer step seen (ns):", g[g > 0].min() if (g > 0).any() else None)
