"""`pan demo --recipe pyramid_flow_ar`: the autoregressive Pyramid-Flow recipe's CPU demo, on the
same synthetic clips (pan.data.synth) and scored by the same analyser (pan.demo.analyser) as the Pan
demo.

    pan demo --recipe pyramid_flow_ar [--out demo_pyramid_flow_ar] [--steps N] [--seed N] [--quick]

Trains a tiny random-init autoregressive Pyramid-Flow DiT in pixel space (identity VAE, tiny text
encoders) and samples the held-out prompts unit by unit.

Everything lands under `--out`: data/ (the synthetic clips), run/ (checkpoints, metrics.jsonl),
samples/ (the scored MP4s, contact_sheet.gif, scores.json), report.md, model/ (the tiny model
folder), pyramid_flow_ar.yaml (the run's config) and loss.png. The recipe's `demo` hook
(pan/recipe.py); docs/demo_recipes.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pan.config import load_config_or_exit
from pan.data.precompute import precompute
from pan.data.synth import DIRECTIONS, PALETTE, SHAPES, caption_for, heldout_combinations
from pan.demo import kit
from pan.demo.kit import PIX_FMT, QUICK, SHAPE_SIZE, fit, fresh_run_dir, make_data, trained_weights
from pan.demo.report import announced, report_scored_samples
from pan.logging import quiet_library_progress_bars
from pan.models.pyramid_flux import PyramidFluxConfig, PyramidFluxTransformer
from pan.models.pyramid_io import save_pretrained
from pan.parallel.threads import set_cpu_threads
from pan.trainer import build_trainer

# The Pan demo's clips (16 x 16, shapes 44-52% of the frame, colour at full resolution): a quarter
# of the tokens of 32 x 32, so 2.5x the steps in the time, which is what drew the shapes.
AR_SIZE, AR_FRAMES = 16, 5  # 5 one-frame units per clip: the unit-by-unit sampler stays quick
# 6000 steps at lr 4e-3 with per-token caption features (a T5 of no layers: the embeddings and the
# final norm), an EMA of the weights and a DiT of width 128: colour, direction and shape read in
# 87-100% of the held-out prompts (docs/demo_recipes.md).
AR_STEPS = 6000
AR_LEARNING_RATE = 4.0e-3
AR_EMA_DECAY = 0.995
T5_LAYERS = 0
CAPTION_WIDTH, POOLED_WIDTH = 32, 32  # T5 and CLIP feature widths, the DiT's text input widths
TINY_DIT = {"in_channels": 12,  # 3 pixel channels x a 2x2 patch
            "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 4,
            "joint_attention_dim": CAPTION_WIDTH, "pooled_projection_dim": POOLED_WIDTH,
            "axes_dims_rope": [8, 12, 12]}
CLIP_LENGTH = 77  # the released CLIP tokenizers' caption length (the encoders pad every CLIP to it)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return kit.parse_args(argv, "pyramid_flow_ar", __doc__.split("\n\n")[0])


def caption_corpus() -> list[str]:
    """Every caption the synthetic data can hold: what the tiny tokenizers learn their sub-words on."""

    return [caption_for(c, s, d) for c in PALETTE for s in SHAPES for d in DIRECTIONS]


def write_clip_tokenizer(folder: Path, corpus: list[str]) -> int:
    """A CLIP byte-level BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json) learnt on
    `corpus`, laid out as CLIPTokenizer reads it; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, end_of_word_suffix="</w>",
                                                        initial_alphabet=alphabet))
    learned = json.loads(bpe.to_str())["model"]
    # CLIP's order: the bytes, the bytes ending a word, the merges, the start and end tokens last.
    base = alphabet + [c + "</w>" for c in alphabet]
    tokens = base + [t for t in learned["vocab"] if t not in set(base)] + ["<|startoftext|>", "<|endoftext|>"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in learned["merges"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CLIPTokenizer", "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": CLIP_LENGTH}))
    return len(tokens)


def write_t5_tokenizer(folder: Path, corpus: list[str]) -> int:
    """A T5 unigram tokenizer whose pieces are `corpus`'s words (scored by their frequency) and, for
    any other text, single characters; returns its vocabulary size.

    Not `UnigramTrainer`: on a corpus this small it keeps single characters only (a caption of 21-26
    tokens, cut at t5_max_length: the direction word never reached the DiT through T5)."""
    import collections
    import math

    from transformers import T5Tokenizer

    words = collections.Counter(f"\u2581{w}" for caption in corpus for w in caption.split())
    chars = sorted({c for caption in corpus for c in caption if not c.isspace()} | {"\u2581"})
    total = sum(words.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(w, math.log(n / total)) for w, n in words.most_common()]
    # a character costs more than any word, so a caption word is always one piece
    pieces += [(c, math.log(1 / total) - 10.0) for c in chars if c not in words]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def write_tiny_pyramid_model(folder: Path, variant: str) -> Path:
    """A random-init Pyramid-Flow release in miniature: the DiT as `variant`, CLIP-L (`text_encoder`)
    and T5 (`text_encoder_2`) with their tokenizers learnt on the demo's captions. Fixed seeds: the
    same folder every time."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    corpus = caption_corpus()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        save_pretrained(PyramidFluxTransformer(PyramidFluxConfig(**TINY_DIT)), folder / variant)
        vocab = write_clip_tokenizer(folder / "tokenizer", corpus)
        CLIPTextModel(CLIPTextConfig(
            vocab_size=vocab, hidden_size=POOLED_WIDTH, intermediate_size=2 * POOLED_WIDTH, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=CLIP_LENGTH, projection_dim=POOLED_WIDTH,
            bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
        )).save_pretrained(folder / "text_encoder")
        T5EncoderModel(T5Config(
            vocab_size=write_t5_tokenizer(folder / "tokenizer_2", corpus), d_model=CAPTION_WIDTH, d_kv=16,
            d_ff=2 * CAPTION_WIDTH, num_layers=T5_LAYERS, num_heads=2, relative_attention_num_buckets=8,
            relative_attention_max_distance=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            use_cache=False)).save_pretrained(folder / "text_encoder_2")
    return folder


def ar_config(args: argparse.Namespace, data: dict[str, Path], model_path: Path, run_dir: Path) -> dict:
    """The run's config: pixel space (identity VAE, no latent statistics), one-frame units."""
    steps = args.steps or (QUICK["steps"] if args.quick else AR_STEPS)
    sample_steps = [2, 2, 2] if args.quick else [10, 10, 10]
    return {
        "recipe": "pyramid_flow_ar",
        "model": {"model_name": "pyramid_flux", "model_path": str(model_path), "vae_type": "identity",
                  "t5_max_length": 16, "attention_backend": "sdpa"},
        "autoregressive": {"frame_per_unit": 1, "video_sync_group": 1},
        "training": {"max_steps": steps, "learning_rate": AR_LEARNING_RATE, "warmup_steps": min(20, steps // 4),
                     "lr_scheduler_type": "cosine", "lr_decay_floor_ratio": 0.1, "weight_decay": 0.0,
                     "max_grad_norm": 1.0, "use_muon": False, "dtype": "fp32", "seed": args.seed,
                     # one kernel for AdamW's update: ~1.5 ms a step against ~5.5 ms (2 threads)
                     "adamw_implementation": "fused", "ema_decay": AR_EMA_DECAY},
        "diffusion": {"image_latent_shift": 0.0, "image_latent_scale": 1.0, "video_latent_shift": 0.0,
                      "video_latent_scale": 1.0},
        "data": {"video_csv_paths": [str(data["train_csv"])], "resolution_buckets": [f"{AR_SIZE}x{AR_SIZE}"],
                 "min_frames": AR_FRAMES, "max_frames": AR_FRAMES, "frames_mod": 1, "frames_remainder": 0,
                 # 16 samples a batch is what binds: a sample is at most ~150 tokens (its unit at 8 x 8
                 # patches and its history), and the token budget leaves room.
                 "max_samples_per_batch": 16, "max_tokens_per_batch": 16 * 700,
                 "packed_dataloader_num_workers": 1,
                 # Each of the 48 clips (~20 KB) read once: torch.load of its two files, ~1.2 ms a
                 # sample in the worker, took the second core from the step's threads (0.10-0.11 s
                 # a step against 0.11-0.14 s, the same losses; docs/demo_recipes.md).
                 "sample_cache_mb": 64},
        "tasks": {"cfg_drop_prob": 0.1},
        "output": {"output_dir": str(run_dir), "save_interval": steps, "log_interval": max(1, steps // 40),
                   "progress_bar": False, "sample_num_frames": AR_FRAMES, "sample_height": AR_SIZE,
                   "sample_width": AR_SIZE, "sample_steps": sample_steps, "sample_video_steps": sample_steps,
                   # Less guidance after the first frame kept the colours from drifting (docs/demo_recipes.md).
                   "sample_guidance_scale": 3.0, "sample_video_guidance_scale": 1.5, "sample_fps": 8.0,
                   # All held-out prompts in one batch: 10 s instead of 29 s, the same MP4 files
                   # byte for byte (each prompt keeps its seed's draws; docs/demo_recipes.md).
                   "sample_batch_size": len(heldout_combinations())},
    }


def make_ar_inputs(data_dir: Path, model_dir: Path, quick: bool) -> tuple[dict[str, Path], Path]:
    """The demo's clips (the Pan demo's: 16 x 16, shapes 44-52% of the frame, 4:4:4) and its tiny
    model folder."""
    with announced("writing the synthetic clips"):
        data = make_data(data_dir, quick, AR_SIZE, AR_FRAMES, shape_size=SHAPE_SIZE, pix_fmt=PIX_FMT)
    with announced("writing the tiny Pyramid-Flow model folder (DiT, CLIP and T5 with their tokenizers)"):
        return data, write_tiny_pyramid_model(model_dir, "diffusion_transformer_384p")


def write_ar_config(args: argparse.Namespace, data: dict[str, Path], model_path: Path, run_dir: Path,
                    config: Path) -> Path:
    """Write the run's config to `config`, training from the clips encoded once (encoded on the first
    call; later calls with the same settings reuse them)."""
    import yaml

    settings = ar_config(args, data, model_path, run_dir)
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    annotations = precompute_ar_clips(config, data["train_csv"].parent)
    settings["data"] |= {"video_csv_paths": [], "annotation_paths": [str(annotations)]}
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    return config


def precompute_ar_clips(config: Path, data_dir: Path) -> Path:
    """Encode every training clip of `config`'s video CSV once (pixels and caption features, `pan data
    precompute` in Pyramid-Flow's format, as the released models are trained) under data_dir/latents;
    returns the annotation file to train from. Decoding the MP4s while training left a step waiting
    for data 33-60% of the time."""
    latents_dir = data_dir / "latents"
    with announced("encoding the training clips once (pixels and caption features)"):
        report = precompute(load_config_or_exit(["--config", str(config)]), latents_dir)
    if report.failures:
        raise SystemExit(f"pan demo: {len(report.failures)} clips failed to encode; see "
                         f"{latents_dir / 'failures.csv'}")
    return report.annotations[0]


def run(args: argparse.Namespace) -> dict:
    out, seconds = args.out, {}
    t0 = time.perf_counter()
    quiet_library_progress_bars()  # (transformers' bars while the tiny encoders are written)
    data, model_path = make_ar_inputs(out / "data", out / "model", args.quick)
    run_dir = out / "run"
    fresh_run_dir(run_dir)
    config = write_ar_config(args, data, model_path, run_dir, out / "pyramid_flow_ar.yaml")
    seconds["data"] = time.perf_counter() - t0
    trainer = build_trainer(load_config_or_exit(["--config", str(config)]))
    seconds["training"] = fit(trainer)

    prompts = json.loads(data["heldout_prompts"].read_text())[:QUICK["num_heldout"] if args.quick else None]
    samples_dir = out / "samples"
    t0 = time.perf_counter()
    with trained_weights(trainer):
        videos = trainer.task.write_samples(trainer.model, [p["prompt"] for p in prompts], samples_dir,
                                            seed=trainer.job.trainer.seed)
    seconds["sampling"] = time.perf_counter() - t0
    return report_scored_samples("pyramid_flow_ar", out, config, run_dir, trainer.state.step, seconds, videos, prompts)


def demo(argv: list[str] | None = None) -> int:
    """The pyramid_flow_ar recipe's `demo` hook: `pan demo --recipe pyramid_flow_ar [options]`."""
    args = parse_args(argv)
    set_cpu_threads()  # before the data phase too (the trainer logs the choice)
    run(args)
    print(f"\nreport: {args.out / 'report.md'}  samples: {args.out / 'samples' / 'contact_sheet.gif'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(demo())
