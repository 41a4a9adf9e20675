"""Ingress decode (base64 + image admission) of an older images.py (argv[1]) vs this checkout, alternating rounds in one
process: python docs/bench/cpu-2026-11-30e-admission-before-after.py /tmp/head/service/admission/images.py
(after `git worktree add /tmp/head a656ad1`)."""
import base64, importlib.util, statistics, sys, time
sys.path.insert(0, ".")
from loadtest.documents import make_documents
import service.admission.images as new
spec = importlib.util.spec_from_file_location("old_images", sys.argv[1])
old = importlib.util.module_from_spec(spec); sys.modules["old_images"] = old; spec.loader.exec_module(old)
def run(mod, b64, n=20):
    t = time.perf_counter()
    for _ in range(n):
        mod.decode_image(mod.decode_base64_image(b64, 50 << 20), allowed_formats=["PNG"], max_pixels=10**8,
                         max_side=10000, max_frames=1)
    return (time.perf_counter() - t) / n * 1000
for kind in ("id_card", "a4"):
    b64 = base64.b64encode(make_documents(kind, 1)[0].png).decode()
    o, n_ = [], []
    for _ in range(5):
        o.append(run(old, b64)); n_.append(run(new, b64))
    print(f"{kind}: before {statistics.median(o):.1f} ms, after {statistics.median(n_):.1f} ms, "
          f"ratio {statistics.median(o)/statistics.median(n_):.2f}")
