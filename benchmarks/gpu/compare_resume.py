"""compare_resume.py STRAIGHT_LOG RESUMED_LOG STRAIGHT_DIR RESUMED_DIR: the resumed run's
iterations against the straight run's (loss and grad norm as logged), and every tensor of
every file of the final checkpoints (model, optimizer, RNG). Passes only if bit-exact."""
import glob
import os
import sys

import torch

from megalite.training_log import parse_log


def rows(path):
    return {log["iteration"]: (log["lm_loss"], log["grad_norm"] or 0.0)
            for log in parse_log(open(path, errors="replace").read())}


def final(d):
    it = int(open(os.path.join(d, "latest_checkpointed_iteration.txt")).read())
    return glob.glob(os.path.join(d, f"iter_*{it}"))[0]


def tensors(obj, prefix=""):
    """Every tensor in a (nested) checkpoint dict, by its path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}")


a, b = rows(sys.argv[1]), rows(sys.argv[2])
ok = "resuming from" in open(sys.argv[2], errors="replace").read()
if not ok:
    print(">> the resumed run did not load the checkpoint")
common = sorted(set(a) & set(b))
if not common:
    sys.exit(">> no iteration logged by both runs")
exact = all(a[i] == b[i] for i in common)
print(f">> iterations {common[0]}-{common[-1]}, loss and grad norm as logged, straight vs "
      f"resumed: {'bit-exact' if exact else 'DIFFERENT: ' + str([(a[i], b[i]) for i in common])}")
ok &= exact
fa, fb = final(sys.argv[3]), final(sys.argv[4])
names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(fa, "*.pt")))
differ = []
for name in names:
    ta = dict(tensors(torch.load(os.path.join(fa, name), weights_only=True, map_location="cpu")))
    tb = dict(tensors(torch.load(os.path.join(fb, name), weights_only=True, map_location="cpu")))
    if ta.keys() != tb.keys() or any(not torch.equal(ta[k], tb[k]) for k in ta):
        differ.append(name)
print(f">> final checkpoint files {names}: "
      f"{'every tensor equal' if not differ else 'DIFFERENT in ' + str(differ)}")
ok &= not differ and bool(names)
rng_files = glob.glob(os.path.join(fb, "rng*.pt"))
if rng_files:
    rng = torch.load(rng_files[0], weights_only=True)
    print(f">> rng file: {sorted(rng)}")
    if torch.cuda.is_available() and "cuda" not in rng:
        print(">> no CUDA RNG state in the checkpoint")
        ok = False
sys.exit(0 if ok else 1)
