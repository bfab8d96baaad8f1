# transformer_threads.py — a Transformer step, plain against Pipes with default, split and unsplit CPU threads (issue 12).
"""Run as ``python3 bench/transformer_threads.py`` (gpipe importable): prints
the median step time (forward + backward) of 4 TransformerEncoderLayers,
plainly and as 2-stage Pipes, interleaved, and plain/this for each."""
import time, torch, gpipe, copy
from torch import nn
torch.manual_seed(0)
def model():
    return nn.Sequential(*[nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True) for _ in range(4)])
m = model(); ref = copy.deepcopy(m)
x = torch.randn(64, 64, 256)
def step(f):
    out = f(x); out.pow(2).mean().backward()
cfgs = {"plain": ref,
        "pipe default (split, except_last)": gpipe.Pipe(copy.deepcopy(m), [2, 2], devices="cpu", chunks=8),
        "pipe split, never": gpipe.Pipe(copy.deepcopy(m), [2, 2], devices="cpu", chunks=8, checkpoint="never"),
        "pipe unsplit(-1), never": gpipe.Pipe(copy.deepcopy(m), [2, 2], devices="cpu", chunks=8, checkpoint="never", intra_op_threads=-1)}
times = {k: [] for k in cfgs}
for k, f in cfgs.items(): step(f)
for r in range(5):
    for k, f in cfgs.items():
        t = time.perf_counter(); step(f); times[k].append(time.perf_counter() - t)
import statistics
base = statistics.median(times["plain"])
for k, v in times.items():
    med = statistics.median(v)
    print(f"{k:40s} {med*1e3:8.1f} ms  plain/this={base/med:.2f}  range {min(v)*1e3:.0f}-{max(v)*1e3:.0f}")
print("threads", torch.get_num_threads())
