"""Ten training prompts in one real ComfyUI server keep its memory flat (a long-running process must not grow)."""
from api_graph import Graph


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_ten_training_prompts_keep_server_rss_flat(comfy_server, checkpoint):
    name, weight_dtype = checkpoint("flux")
    rss = []
    for run in range(10):
        g = Graph()
        # a new seed each run, so ComfyUI's cache cannot skip the training node
        g.train_flux((name, weight_dtype), prefix="tightrope/it_leak", images="it_leak_images", steps=2, seed=run)
        comfy_server.run(g.nodes)
        rss.append(_rss_mib(comfy_server.proc.pid))
    print("server RSS after each run (MiB):", [round(r) for r in rss])
    assert comfy_server.alive()
    assert max(rss[3:]) - rss[2] < 40, rss  # after warm-up (allocator pools, caches) growth stays small
