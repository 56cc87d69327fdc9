"""Images in: preprocessing, the vision tower and time to first token, Lumen vs transformers, random weights.

    python benchmarks/vision.py [--device cpu|cuda:0 --models qwen3.5-9b,gemma4-26b --image-size 1024
                                 --text-layers 2 --repeat 3 --vocab 0 --dtype float32 --json OUT]

One fixed random RGB image (``--image-size`` square, seed 0) and, per model, a random checkpoint that transformers
builds and saves (``save_pretrained`` of a random-init ``*ForConditionalGeneration``): the real vision tower at its
real depth and the real text layer shapes, cut to ``--text-layers`` layers (the last one full attention). The
checkpoint directory also gets the family's real ``preprocessor_config.json``. Tower shapes (the published
``vision_config`` of each model):

- ``qwen3.5-9b``: Qwen3.5-9B's ViT, 27 blocks of hidden 1152, MLP 4304, 16 heads, patch 16, temporal patch 2,
  merge 2 into the text width 4096, 2304 learned positions (``Qwen/Qwen3.5-9B`` config.json). Its processor
  resizes to multiples of 32 within 65536..16777216 pixels: a 1024x1024 image stays 1024x1024, 4096 patches,
  1024 image tokens. Text: hidden 4096, 16 heads / 4 kv of 256, 32 linear value heads, 3 linear : 1 full.
- ``gemma4-26b``: Gemma-4-26B-A4B's encoder, 27 layers of hidden 1152, MLP 4304, 16 heads (16 kv) of 72, patch 16,
  pooling 3, 10240 positions, standardized output (``google/gemma-4-26B-A4B-it`` config.json). Its processor
  fits the image into 280 soft tokens (2520 patches): 1024x1024 becomes 768x768, 2304 patches, 256 image tokens.
  Text: hidden 2816, 16 heads / 8 kv of 256 (full layers: 512, 2 kv, k = v), a dense MLP of 2112 beside 128
  experts of 704 (top 8), 5 sliding : 1 full.

Measured, for each engine on the same image and the same token ids (the prompt is ~20 random text ids around the
model's image placeholder, expanded by Lumen into the image's tokens; transformers gets those expanded ids):

- (a) preprocessing: Lumen ``engine.images_in([image])``; transformers the ``AutoImageProcessor`` of the checkpoint
  (its default class, named in the output) to tensors on the device.
- (b) the tower: Lumen ``engine.model.encode_images(inputs)`` (the projection into the text width included; on CUDA
  the tower runs in CuPy float32, see docs/vision.md); transformers ``model.model.get_image_features(...)`` on the
  pixel values of (a), under ``torch.inference_mode``.
- (c) time to first token: Lumen ``engine.generate_tokens(ids, 1, images=[image])`` (preprocess + tower + prefill of
  the expanded prompt + the first token); transformers its processor + ``generate(max_new_tokens=1)``, greedy.
  ``c - a - b`` is the text part (prefill of ``--text-layers`` layers + the first token's lm_head row): it grows
  with the layer count, (a) and (b) do not.

Each engine first runs (c) once untimed on a small image (``WARM_SIZE``; Qwen's processor upscales it to
256x256, Gemma 4's to its full 280-token budget, so there the warm-up costs a whole tower), then (a), (b), (c)
``--repeat`` times on the real image; the table gives the median, ratio = transformers / Lumen (> 1: Lumen
faster). Each timed block also records how busy other processes kept the cores (``_timing.Probe``), printed and
in the JSON. ``--vision-layers`` cuts the tower's depth (tests; or per-layer and fixed cost apart from two runs).
The engines run one after the other (one model in memory at a time). ``--vocab`` shrinks the vocabulary (0: the
real one) to keep the CPU run in memory; it only changes the embedding table and the one lm_head row of the first
token. Dev tool: torch, transformers (and CuPy for ``--device cuda:N``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from _timing import Probe, limit_threads, machine, quiet_pause

# Published shapes. Sources: the config.json of Qwen/Qwen3.5-9B and google/gemma-4-26B-A4B-it on the Hugging Face
# hub (as mirrored in public repositories' fixtures); the text shapes from the team's reference notes
# (REFERENCE.md, kept outside this repository).
MODELS = {
    "qwen3.5-9b": {
        "family": "qwen",
        "vision": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
                       num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[]),
        "text": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        "vocab": 248320,
        # image_token_id, video_token_id, vision_start_token_id, vision_end_token_id (published ids)
        "tokens": {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                   "vision_end_token_id": 248054},
        "preprocessor": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                         "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                         "image_processor_type": "Qwen2VLImageProcessorFast"},
    },
    "gemma4-26b": {
        "family": "gemma4",
        "vision": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       num_key_value_heads=16, head_dim=72, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       patch_size=16, pooling_kernel_size=3, position_embedding_size=10240, standardize=True,
                       use_clipped_linears=False,
                       # as published; transformers 5.23 reads and saves it as rope_type "axial"
                       rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "text": dict(hidden_size=2816, intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
                     sliding_window=1024, enable_moe_block=True, num_experts=128, top_k_experts=8,
                     moe_intermediate_size=704, hidden_size_per_layer_input=0, tie_word_embeddings=True,
                     final_logit_softcapping=30.0),
        "vocab": 262144,
        "tokens": {"image_token_id": 258880, "audio_token_id": 258881, "video_token_id": 258884,
                   "boi_token_id": 255999, "eoi_token_id": 258882, "boa_token_id": 256000,
                   "eoa_token_index": 258883},
        "preprocessor": {"image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True,
                         "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
                         "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "patch_size": 16,
                         "pooling_kernel_size": 3, "max_soft_tokens": 280},
    },
}
WARM_SIZE = 96  # the warm-up image's side: every kernel of the real run, a fraction of its cost
TEXT_IDS = (100, 5000)  # random prompt ids come from here (clear of every special id, at any --vocab >= 5000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (both engines)")
    p.add_argument("--models", default="qwen3.5-9b,gemma4-26b", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--image-size", type=int, default=1024, help="side of the square random RGB image")
    p.add_argument("--text-layers", type=int, default=4, help="text layers of the checkpoint (the last: full attn)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each measurement (median reported)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the model's real one)")
    p.add_argument("--vision-layers", type=int, default=0, help="tower depth (0: the real 27; smaller for tests)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="checkpoint dtype and transformers' compute dtype (Lumen's CUDA tower computes in f32)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both engines (0: all cores)")
    p.add_argument("--engines", default="lumen,transformers")
    p.add_argument("--workdir", default="/tmp/lumen-bench-vision")
    p.add_argument("--json", metavar="OUT")
    return p.parse_args(argv)


# -- the checkpoint ---------------------------------------------------------------------------------------------
def layer_types(family: str, n: int) -> list[str]:
    if family == "qwen":
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    else:
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    kinds[-1] = "full_attention"  # image tokens meet the full-attention path even at 1-3 layers
    return kinds


def token_ids(spec: dict, vocab: int) -> dict:
    """The published special ids, or (with a smaller --vocab) the same ids moved to the top of the vocabulary."""
    if vocab >= spec["vocab"]:
        return dict(spec["tokens"])
    return {k: vocab - 1 - i for i, k in enumerate(spec["tokens"])}


def build(name: str, args) -> Path:
    """Save a random-init checkpoint of ``name`` (cached in --workdir by its shape); -> its directory."""
    import torch
    import transformers as tf

    spec = MODELS[name]
    vocab = args.vocab or spec["vocab"]
    vision = dict(spec["vision"])
    if args.vision_layers:
        vision["depth" if spec["family"] == "qwen" else "num_hidden_layers"] = args.vision_layers
    out = Path(args.workdir) / (f"{name}-t{args.text_layers}-v{args.vision_layers or 27}-vocab{vocab}-"
                                f"{args.dtype}")
    if (out / "config.json").exists() and (out / "preprocessor_config.json").exists():
        return out
    ids = token_ids(spec, vocab)
    text = dict(spec["text"], vocab_size=vocab, num_hidden_layers=args.text_layers,
                layer_types=layer_types(spec["family"], args.text_layers), max_position_embeddings=8192)
    if spec["family"] == "qwen":
        text.update(eos_token_id=vocab - 10, pad_token_id=vocab - 11)
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
        cls = tf.Qwen3_5ForConditionalGeneration
    else:
        # pad away from id 0: HF zeroes the pad row of the embeddings, and Lumen warms up on id 0 without a tokenizer
        text.update(vocab_size_per_layer_input=vocab, bos_token_id=2, eos_token_id=1, pad_token_id=vocab - 20)
        cfg = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, tie_word_embeddings=True,
                              **ids)
        cls = tf.Gemma4ForConditionalGeneration
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device("cuda" if args.device.startswith("cuda") else "cpu"):
        model = cls(cfg).to(dtype).eval()
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    (tmp / "preprocessor_config.json").write_text(json.dumps(spec["preprocessor"], indent=2) + "\n")
    del model
    gc.collect()
    tmp.rename(out)
    return out


# -- the prompt and the image -------------------------------------------------------------------------------------
def picture(size: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(0).randint(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def prompt(name: str, path: Path) -> list[int]:
    """~20 random text ids around the model's image placeholder (before Lumen expands it)."""
    import numpy as np

    cfg = json.loads((path / "config.json").read_text())
    rng = np.random.RandomState(1)
    before, after = rng.randint(*TEXT_IDS, 6).tolist(), rng.randint(*TEXT_IDS, 12).tolist()
    if MODELS[name]["family"] == "qwen":
        image = [cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]]
    else:
        image = [cfg["image_token_id"]]  # Lumen's Gemma 4 placeholder: <|image|>, expanded to <|image> ... <image|>
    return before + image + after


# -- timing -----------------------------------------------------------------------------------------------------
class Sync:
    def __init__(self, device: str):
        self.device = device

    def __call__(self):
        if not self.device.startswith("cuda"):
            return
        try:
            import cupy

            cupy.cuda.Device(int(self.device.split(":")[1] if ":" in self.device else 0)).synchronize()
        except ImportError:
            pass
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()


FOREIGN: list[float] = []  # per timed block: the share of the cores other processes kept busy (_timing.Probe)


def clock(fn, sync) -> tuple[float, object]:
    quiet_pause()
    sync()
    with Probe() as probe:
        out = fn()
        sync()
    if probe.foreign is not None:
        FOREIGN.append(probe.foreign)
    return probe.wall, out


def run_lumen(path: Path, ids: list[int], image, warm, args, sync) -> dict:
    import lumen_core as lumen

    cuda = args.device.startswith("cuda")
    t = time.perf_counter()
    engine = lumen.load({"model": {"path": str(path), "compute": args.device, "store": "vram" if cuda else "ram",
                                   "hidden-layers": {"kv-cache": {"context-size": 4096}}},
                         "vision": {"compute": args.device}}, progress=False)
    out = {"load_s": time.perf_counter() - t, "a": [], "b": [], "c": []}
    n0 = len(FOREIGN)

    def once(img, keep: bool):
        if not keep:  # warm-up: the whole path once (the tower's kernels compile here)
            list(engine.generate_tokens(ids, 1, images=[img]))
            sync()
            return
        ta, inputs = clock(lambda: engine.images_in([img]), sync)
        tb, _ = clock(lambda: engine.model.encode_images(inputs), sync)
        tc, toks = clock(lambda: list(engine.generate_tokens(ids, 1, images=[img])), sync)
        out["a"].append(ta)
        out["b"].append(tb)
        out["c"].append(tc)
        out["first_token"] = toks[0] if toks else None
        out["image_tokens"] = inputs[0].num_tokens
        out["grid"] = list(inputs[0].grid)
        out["prompt_tokens"] = engine.stats.prompt_tokens
        out["expanded_ids"] = engine.arch.expand_image_tokens(list(ids), inputs)

    once(warm, False)
    for i in range(args.repeat):
        once(image, True)
        print(f"  lumen run {i + 1}/{args.repeat}: a {out['a'][-1] * 1e3:.1f} ms, b {out['b'][-1] * 1e3:.1f} ms, "
              f"c {out['c'][-1] * 1e3:.1f} ms", file=sys.stderr)
    out["foreign"] = FOREIGN[n0:]
    engine = None  # noqa: F841 - freed before the next engine loads
    gc.collect()
    if cuda:
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        except ImportError:
            pass
    return out


def run_hf(name: str, path: Path, ids: list[int], image, warm, args, sync) -> dict:
    """transformers on the same checkpoint, image and (expanded) ids; a dict with ``error`` where the installed
    transformers lacks a class this needs."""
    try:
        import torch
        import transformers as tf
        from transformers import AutoImageProcessor
    except ImportError as exc:
        return {"error": f"import failed: {exc}"}
    family = MODELS[name]["family"]
    cls_name = "Qwen3_5ForConditionalGeneration" if family == "qwen" else "Gemma4ForConditionalGeneration"
    cls = getattr(tf, cls_name, None)
    if cls is None:
        return {"error": f"transformers {tf.__version__} has no {cls_name}"}
    device = torch.device(args.device)
    try:
        processor = AutoImageProcessor.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the Lumen column still stands
        return {"error": f"AutoImageProcessor: {type(exc).__name__}: {exc}"}
    t = time.perf_counter()
    model = cls.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    out = {"load_s": time.perf_counter() - t, "a": [], "b": [], "c": [], "processor": type(processor).__name__,
           "transformers": tf.__version__, "torch": torch.__version__}
    image_id = model.config.image_token_id
    n0 = len(FOREIGN)

    def preprocess(img):  # to the device, pixels in the model's dtype: what the tower takes
        feats = processor(images=[img], return_tensors="pt")
        return {k: v.to(device, model.dtype) if v.is_floating_point() else v.to(device) for k, v in feats.items()
                if k in ("pixel_values", "image_grid_thw", "image_position_ids")}

    def tower(feats):
        with torch.inference_mode():
            if family == "qwen":
                return model.model.get_image_features(feats["pixel_values"], feats["image_grid_thw"])
            return model.model.get_image_features(feats["pixel_values"], feats["image_position_ids"])

    types = {"mm_token_type_ids": True}  # transformers 5.23 wants them; dropped if an older version refuses them

    def ttft(img, expanded):
        feats = preprocess(img)
        x = torch.tensor([expanded], device=device)
        extra = {"mm_token_type_ids": (x == image_id).int()} if types["mm_token_type_ids"] else {}
        with torch.inference_mode():
            seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **feats, **extra, max_new_tokens=1,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return seq[0, len(expanded):].tolist()

    def once(img, expanded, keep: bool):
        if not keep:  # warm-up: the whole path once (without the token types if this transformers refuses them)
            try:
                ttft(img, expanded)
            except (TypeError, ValueError) as exc:
                print(f"  transformers generate with mm_token_type_ids: {exc}; again without", file=sys.stderr)
                types["mm_token_type_ids"] = False
                out["note"] = f"generate without mm_token_type_ids ({type(exc).__name__}: {exc})"
                ttft(img, expanded)
            sync()
            return
        ta, feats = clock(lambda: preprocess(img), sync)
        tb, _ = clock(lambda: tower(feats), sync)
        tc, toks = clock(lambda: ttft(img, expanded), sync)
        out["a"].append(ta)
        out["b"].append(tb)
        out["c"].append(tc)
        out["first_token"] = toks[0] if toks else None

    try:
        once(warm[0], warm[1], False)
        for i in range(args.repeat):
            once(image, ids, True)
            print(f"  transformers run {i + 1}/{args.repeat}: a {out['a'][-1] * 1e3:.1f} ms, "
                  f"b {out['b'][-1] * 1e3:.1f} ms, c {out['c'][-1] * 1e3:.1f} ms", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - an API difference in another transformers version: report it
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["foreign"] = FOREIGN[n0:]
    model = None  # noqa: F841 - freed before the next engine loads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_model(name: str, args, sync) -> dict:
    t = time.perf_counter()
    path = build(name, args)
    print(f"{name}: checkpoint {path} ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    ids = prompt(name, path)
    image, warm = picture(args.image_size), picture(WARM_SIZE)
    row = {"checkpoint": str(path), "text_layers": args.text_layers,
           "vocab": json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]}
    engines = args.engines.split(",")
    # the prompt expanded for each image (Lumen's expansion, equal to transformers' processor's): the same ids
    # for both engines
    expanded, warm_expanded = lumen_expanded(path, ids, [image, warm])
    if "lumen" in engines:
        row["lumen"] = run_lumen(path, ids, image, warm, args, sync)
        if row["lumen"]["expanded_ids"] != expanded:
            raise SystemExit(f"{name}: generate_tokens expanded the prompt differently from expand_image_tokens")
        del row["lumen"]["expanded_ids"]
    if "transformers" in engines:
        row["transformers"] = run_hf(name, path, expanded, image, (warm, warm_expanded), args, sync)
    return row


def lumen_expanded(path: Path, ids: list[int], images: list) -> tuple[list[int], list[int]]:
    """The prompt expanded for each image by Lumen's preprocessor (no weights loaded)."""
    from lumen_core.checkpoint import open_checkpoint
    from lumen_core.plugins import get_registry

    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    arch = registry.architecture_class(ckpt.config["model_type"]).from_checkpoint(ckpt)
    proc = arch.image_processor(ckpt.preprocessor_config())
    return tuple(arch.expand_image_tokens(list(ids), [proc.preprocess(img, label="image 1")]) for img in images)


# -- report -------------------------------------------------------------------------------------------------------
STEPS = (("a", "preprocess"), ("b", "tower"), ("c", "TTFT"))


def table(results: dict, args) -> str:
    lines = ["| model | device | step | Lumen ms | transformers ms | ratio |", "|---|---|---|---:|---:|---:|"]
    for name, row in results.items():
        L, H = row.get("lumen") or {}, row.get("transformers") or {}
        for key, label in STEPS:
            lm = statistics.median(L[key]) * 1e3 if L.get(key) else float("nan")
            hm = statistics.median(H[key]) * 1e3 if H.get(key) else float("nan")
            ratio = f"{hm / lm:.2f}x" if L.get(key) and H.get(key) else "-"
            lines.append(f"| {name} | {args.device} | ({key}) {label} | {lm:.1f} | {hm:.1f} | {ratio} |")
        for engine, r in (("Lumen", L), ("transformers", H)):
            if all(r.get(k) for k, _ in STEPS):
                rest = (statistics.median(r["c"]) - statistics.median(r["a"]) - statistics.median(r["b"])) * 1e3
                lines.append(f"| {name} | {args.device} | c - a - b ({engine}: {row['text_layers']} text layers "
                             f"+ first token) | {rest:.1f} | | |" if engine == "Lumen" else
                             f"| {name} | {args.device} | c - a - b ({engine}: {row['text_layers']} text layers "
                             f"+ first token) | | {rest:.1f} | |")
    return "\n".join(lines) + "\n\n(median of --repeat; ratio = transformers / Lumen, > 1: Lumen faster)"


def main(argv=None) -> dict:
    args = parse_args(argv)
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}: {', '.join(MODELS)}")
    import os

    threads = args.threads or os.cpu_count() or 1
    limit_threads(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    sync = Sync(args.device)
    results = {}
    info = {"args": vars(args), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "threads": threads, "results": results}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(int(args.device.split(":")[1]) if ":" in args.device else 0)
    for name in args.models.split(","):
        results[name] = row = bench_model(name, args, sync)
        for engine in ("lumen", "transformers"):
            if (row.get(engine) or {}).get("error"):
                print(f"{name}: {engine}: {row[engine]['error']}", file=sys.stderr)
        if args.json:  # after every model: a run cut short keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(info, indent=2, default=str) + "\n")
    mach = info["machine"]
    where = info.get("gpu") or f"{mach['cpu']}, {threads} threads"
    print(f"\none {args.image_size}x{args.image_size} random RGB image; {where}; checkpoint dtype {args.dtype}; "
          f"text layers {args.text_layers}; vision layers {args.vision_layers or 27}\n")
    for name, row in results.items():
        L, H = row.get("lumen") or {}, row.get("transformers") or {}
        print(f"{name}: {L.get('image_tokens', '?')} image tokens (grid {L.get('grid', '?')}), prompt "
              f"{L.get('prompt_tokens', '?')} tokens, vocab {row['vocab']}; transformers "
              f"{H.get('transformers', '?')} ({H.get('processor', '?')}); first token Lumen {L.get('first_token')} / "
              f"transformers {H.get('first_token')}"
              + (f"; transformers error: {H['error']}" if H.get("error") else ""))
    busy = [f for row in results.values() for e in ("lumen", "transformers")
            for f in (row.get(e) or {}).get("foreign", [])]
    if busy:
        print(f"other processes kept up to {max(busy):.0%} of the cores busy during a timed block (median "
              f"{statistics.median(busy):.0%}); per block in the JSON")
    print()
    print(table(results, args))
    return info


if __name__ == "__main__":
    main()
