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
        unet = g.add("UNETLoader", unet_name=name, weight_dtype=weight_dtype)
        images = g.add("TightropeDemoImages", subfolder="it_leak_images", count=4, size=64, seed=0)
        vae = g.add("VAELoader", vae_name="taef1")
        encoders = g.add("TightropeDemoEncoders", seed=0)
        dataset = g.add("TightropeLoadDataset", folder=[images, 0], vae=[vae, 0], clip=[encoders, 1], resolution=64)
        lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0)
        # a new seed each run, so ComfyUI's cache cannot skip the training node
        train = g.add("TightropeTrain", steps=2, seed=run, device="cpu", filename_prefix="tightrope/it_leak",
                      model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0])
        g.add("TightropeSaveLora", session=[train, 0], filename_prefix="tightrope/it_leak_final")
        comfy_server.run(g.nodes)
        rss.append(_rss_mib(comfy_server.proc.pid))
    print("server RSS after each run (MiB):", [round(r) for r in rss])
    assert comfy_server.alive()
    assert max(rss[3:]) - rss[2] < 40, rss  # after warm-up (allocator pools, caches) growth stays small
