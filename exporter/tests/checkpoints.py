"""Tiny seeded LeRobot checkpoints, made with LeRobot's own classes and `save_pretrained`.

Random weights (nothing is downloaded: `pretrained_backbone_weights=None`) and non-trivial
statistics: means far from 0, stds far from 1, ranges far from [-1, 1], so a bundle that skipped
a normalisation would give visibly different actions. Sized to export in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.factory import make_pre_post_processors

STATE = 6
ACTION = 6


def _stats(g: torch.Generator, features: dict[str, PolicyFeature]) -> dict:
    stats = {}
    for key, f in features.items():
        if f.type is FeatureType.VISUAL:
            c = f.shape[0]
            mean = 0.3 + 0.4 * torch.rand(c, 1, 1, generator=g)
            std = 0.1 + 0.3 * torch.rand(c, 1, 1, generator=g)
            lo, hi = torch.zeros(c, 1, 1), torch.ones(c, 1, 1)
        else:
            d = f.shape[0]
            mean = 3.0 * torch.randn(d, generator=g)
            std = 0.2 + 2.0 * torch.rand(d, generator=g)
            lo = mean - 2.5 * std
            hi = mean + 2.5 * std
        # Quantiles inside the range (pi0.5 normalises with q01/q99).
        q01, q99 = lo + 0.05 * (hi - lo), hi - 0.05 * (hi - lo)
        stats[key] = {"mean": mean, "std": std, "min": lo, "max": hi, "q01": q01, "q99": q99}
    return stats


def _save(policy: torch.nn.Module, cfg: object, out: Path, g: torch.Generator) -> Path:
    features = {**cfg.input_features, **cfg.output_features}
    pre, post = make_pre_post_processors(cfg, dataset_stats=_stats(g, features))
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out


def act(
    out: Path, seed: int = 0, cameras: int = 1, h: int = 48, w: int = 64, full: bool = False
) -> Path:
    """ACT with a ResNet18 backbone (LeRobot's only choice) on small images, a 10-step chunk;
    `full`: LeRobot's default sizes (dim 512, 4 encoder layers, chunk 100; 52M parameters)."""
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (STATE,))}
    for i in range(cameras):
        inputs[f"observation.images.cam{i}"] = PolicyFeature(FeatureType.VISUAL, (3, h, w))
    small = {
        "chunk_size": 10,
        "n_action_steps": 10,
        "dim_model": 32,
        "n_heads": 2,
        "dim_feedforward": 64,
        "n_encoder_layers": 1,
        "n_decoder_layers": 1,
        "n_vae_encoder_layers": 1,
        "latent_dim": 8,
    }
    cfg = ACTConfig(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION,))},
        pretrained_backbone_weights=None,
        device="cpu",
        **({} if full else small),
    )
    return _save(ACTPolicy(cfg), cfg, out, g)


def diffusion(
    out: Path,
    seed: int = 0,
    scheduler: str = "DDIM",
    steps: int | None = 10,
    cameras: int = 1,
    full: bool = False,
    image: tuple[int, int] = (96, 96),
    resize: tuple[int, int] | None = None,
) -> Path:
    """Diffusion Policy, PushT-like: 2 observation steps of 96×96 images (or `image`) cropped to
    84, horizon 16, 8 actions kept; a small U-Net (down_dims 32/64/128), or with `full`
    LeRobot's default; MIN_MAX state and action as LeRobot's defaults. `resize`: the encoder's
    `resize_shape` (torchvision's antialiased Resize), then the crop."""
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (STATE,))}
    for i in range(cameras):
        inputs[f"observation.images.cam{i}"] = PolicyFeature(FeatureType.VISUAL, (3, *image))
    extra: dict = {} if resize is None else {"resize_shape": resize}
    cfg = DiffusionConfig(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION,))},
        n_obs_steps=2,
        horizon=16,
        n_action_steps=8,
        crop_shape=(84, 84),
        **(
            {}  # LeRobot's defaults: down_dims 512/1024/2048, a 250M-parameter U-Net
            if full
            else {
                "down_dims": (32, 64, 128),
                "diffusion_step_embed_dim": 32,
                "spatial_softmax_num_keypoints": 16,
            }
        ),
        noise_scheduler_type=scheduler,
        **extra,
        num_train_timesteps=100,
        num_inference_steps=steps,
        pretrained_backbone_weights=None,
        device="cpu",
        normalization_mapping={
            "VISUAL": NormalizationMode.MEAN_STD,
            "STATE": NormalizationMode.MIN_MAX,
            "ACTION": NormalizationMode.MIN_MAX,
        },
    )
    return _save(DiffusionPolicy(cfg), cfg, out, g)


# pi0: LeRobot 0.6.1 hard-codes PaliGemma's sizes (Gemma 2B + 300M, SigLIP So400m, a 257,152
# vocabulary: 3.3B parameters). `tiny_pi0` patches those tables inside this process only, so a
# checkpoint made under it loads only under it too: export and verify run in-process.
PI_WIDTH = 64
PI_VOCAB = 512


def _tiny_gemma(module: object) -> object:
    def config(variant: str) -> object:
        if variant == "gemma_2b":
            return module.GemmaConfig(
                width=PI_WIDTH, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16
            )
        return module.GemmaConfig(
            width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16
        )

    return config


@contextlib.contextmanager
def tiny_pi0() -> Iterator[None]:
    """pi0's and pi0.5's size tables (each module has its own copy) at tiny sizes."""
    import lerobot.policies.pi0.modeling_pi0 as pi0_module
    import lerobot.policies.pi05.modeling_pi05 as pi05_module

    with pytest.MonkeyPatch.context() as mp:
        for m in (pi0_module, pi05_module):
            original = m.PaliGemmaForConditionalGenerationWithPiGemma

            class Tiny(original):
                def __init__(self, config: object) -> None:
                    v = config.vision_config
                    v.hidden_size, v.num_hidden_layers, v.num_attention_heads = 32, 1, 2
                    v.intermediate_size, v.patch_size, v.projection_dim = 64, 28, PI_WIDTH
                    config.text_config.vocab_size = PI_VOCAB
                    super().__init__(config)

            mp.setattr(m, "get_gemma_config", _tiny_gemma(m))
            mp.setattr(m, "PaliGemmaForConditionalGenerationWithPiGemma", Tiny)
        yield


def gemma_tokenizer(out: Path) -> Path:
    """A SentencePiece BPE model like Gemma's (special ids pad 0, eos 1, bos 2, unk 3, a "\\n"
    piece, whitespace kept), trained here on a few robot tasks, as a Hugging Face tokenizer
    directory."""
    import json

    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    tasks = [
        "pick up the red cube",
        "put the bowl on the stove",
        "open the top drawer and put the bowl inside",
        "fold the towel",
        "place the marker in the cup",
    ]
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(tasks * 40))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "tokenizer"),
        vocab_size=300,
        model_type="bpe",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        byte_fallback=True,
        add_dummy_prefix=False,
        # Gemma's normaliser keeps whitespace as it is (and so does Hugging Face's converted
        # Gemma tokenizer, which LeRobot runs).
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        user_defined_symbols=["\n"],
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GemmaTokenizer", "add_bos_token": True})
    )
    return out


def pi0(
    out: Path,
    tokenizer: Path,
    seed: int = 0,
    cameras: int = 1,
    pi05: bool = False,
    chunk: int = 10,
    image: tuple[int, int] = (224, 224),
    relative: bool = False,
) -> Path:
    """pi0 (or pi0.5) at tiny sizes (under `tiny_pi0`), cameras recorded at `image` (height,
    width; the model takes 224×224 and resizes with padding), a chunk of `chunk` actions,
    prompts of 16 tokens (pi0.5: 48, the state is in them), its preprocessor's tokenizer the
    local `tokenizer` directory; `relative`: `use_relative_actions`, the gripper kept
    absolute."""
    if pi05:
        import lerobot.policies.pi05.processor_pi05 as pp
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy

        make = pp.make_pi05_pre_post_processors
    else:
        import lerobot.policies.pi0.processor_pi0 as pp
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy

        make = pp.make_pi0_pre_post_processors
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (STATE,))}
    for i in range(cameras):
        inputs[f"observation.images.cam{i}"] = PolicyFeature(FeatureType.VISUAL, (3, *image))
    extra = {}
    if relative:
        extra = {
            "use_relative_actions": True,
            "action_feature_names": [f"joint{j}" for j in range(ACTION - 1)] + ["gripper"],
        }
    cfg = Config(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION,))},
        device="cpu",
        dtype="float32",
        tokenizer_max_length=48 if pi05 else 16,
        chunk_size=chunk,
        n_action_steps=chunk,
        **extra,
    )
    policy = Policy(cfg)
    features = {**cfg.input_features, **cfg.output_features}
    step = pp.TokenizerProcessorStep
    with pytest.MonkeyPatch.context() as mp:
        # LeRobot names the Hub's PaliGemma tokenizer; a checkpoint may name a directory.
        mp.setattr(
            pp,
            "TokenizerProcessorStep",
            lambda tokenizer_name, **kw: step(tokenizer_name=str(tokenizer), **kw),
        )
        pre, post = make(cfg, dataset_stats=_stats(g, features))
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out


#: The tasks the tiny VLM tokenizers are trained on.
TASKS = [
    "pick up the red cube",
    "put the bowl on the stove",
    "open the top drawer and put the bowl inside",
    "fold the towel",
]


def _byte_level_bpe(special: list[str], tasks: list[str]) -> object:
    """A 400-token byte-level BPE trained on `tasks`, with `special` as its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(tasks * 50, trainer)
    return tok


def tiny_smolvlm(out: Path) -> Path:
    """A tiny SmolVLM as a local directory (config, processor, byte-level BPE tokenizer with
    SmolVLM's image tokens): what SmolVLA reads by `vlm_model_name`, which may be a path."""
    from transformers import (
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<global-img>",
        "<image>",
    ]
    tok = _byte_level_bpe(special, TASKS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "image_token": "<image>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )
    images = SmolVLMImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 64})
    SmolVLMProcessor(
        image_processor=images,
        tokenizer=fast,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=4,
    ).save_pretrained(out)
    SmolVLMConfig(
        text_config={
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 512,
            "max_position_embeddings": 512,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 16,
        },
        scale_factor=2,
        image_token_id=fast.convert_tokens_to_ids("<image>"),
    ).save_pretrained(out)
    return out


def smolvla(out: Path, vlm: Path, seed: int = 0, empty_cameras: int = 0) -> Path:
    """SmolVLA over the tiny SmolVLM at `vlm`: one 48×64 camera (resized with padding to 64×64
    inside the model), prompts of at most 16 tokens, chunk 10; `empty_cameras` more that no
    robot sends."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = SmolVLAConfig(
        input_features={
            "observation.state": PolicyFeature(FeatureType.STATE, (STATE,)),
            "observation.images.cam0": PolicyFeature(FeatureType.VISUAL, (3, 48, 64)),
        },
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION,))},
        vlm_model_name=str(vlm),
        load_vlm_weights=False,
        device="cpu",
        resize_imgs_with_padding=(64, 64),
        num_vlm_layers=4,
        chunk_size=10,
        n_action_steps=10,
        tokenizer_max_length=16,
        empty_cameras=empty_cameras,
    )
    policy = SmolVLAPolicy(cfg)
    features = {**cfg.input_features, **cfg.output_features}
    pre, post = make_smolvla_pre_post_processors(cfg, dataset_stats=_stats(g, features))
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out


#: What the tests' openpi checkpoints are, per openpi training config: pi0.5 or pi0, the action
#: horizon, the asset id, the state's and the actions' sizes. Read from openpi's
#: `training/config.py` and `policies/{libero,droid}_policy.py` for the tests, apart from the
#: exporter's table.
OPENPI = {
    "pi0_libero": (False, 50, "physical-intelligence/libero", 8, 7),
    "pi05_libero": (True, 10, "physical-intelligence/libero", 8, 7),
    "pi0_droid": (False, 10, "droid", 8, 8),
    "pi05_droid": (True, 15, "droid", 8, 8),
    "pi05_full_droid_finetune": (True, 16, "droid", 8, 8),
    "pi0_aloha": (False, 50, "trossen", 14, 14),
    "pi05_aloha": (True, 50, "trossen", 14, 14),
    "pi0_aloha_sim": (False, 50, "lerobot/aloha_sim_transfer_cube_human", 14, 14),
}


def openpi_checkpoint(out: Path, name: str, seed: int = 0, pi05: bool | None = None) -> Path:
    """A tiny pi0 / pi0.5 (under `tiny_pi0`) as openpi's converter writes it: the PI0Pytorch
    module saved in bfloat16 with `safetensors.torch.save_model`, `lm_head` tied to the
    embedding (so only `lm_head` is written), openpi's `config.json`, and
    `assets/<asset_id>/norm_stats.json` with statistics far from identity. `pi05` overrides
    the config's model (a checkpoint that does not match its config)."""
    import json

    from safetensors.torch import save_model

    is_pi05, horizon, asset, state, actions = OPENPI[name]
    if pi05 is not None:
        is_pi05 = pi05
    if is_pi05:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    else:
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    torch.manual_seed(seed)
    cfg = Config(
        input_features={"observation.state": PolicyFeature(FeatureType.STATE, (state,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (actions,))},
        device="cpu",
        dtype="float32",
        chunk_size=horizon,
        n_action_steps=horizon,
    )
    model = Policy(cfg).model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Every tensor away from its initial value (LeRobot zero-initialises some), so a
        # tensor loaded wrongly shows in the actions.
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    pg = model.paligemma_with_expert.paligemma
    pg.lm_head.weight = pg.model.language_model.embed_tokens.weight
    out.mkdir(parents=True)
    save_model(model.to(torch.bfloat16), str(out / "model.safetensors"))
    (out / "config.json").write_text(
        json.dumps(
            {
                "action_dim": 32,
                "action_horizon": horizon,
                "paligemma_variant": "gemma_2b",
                "action_expert_variant": "gemma_300m",
                "precision": "bfloat16",
            }
        )
    )

    def stats(d: int) -> dict[str, list[float]]:
        mean = 3.0 * torch.randn(d, generator=g)
        std = 0.2 + 2.0 * torch.rand(d, generator=g)
        q01 = mean - 2.0 * std * (0.5 + torch.rand(d, generator=g))
        q99 = mean + 2.0 * std * (0.5 + torch.rand(d, generator=g))
        return {k: v.tolist() for k, v in dict(mean=mean, std=std, q01=q01, q99=q99).items()}

    state_stats = stats(state)
    if "aloha" in name:
        # The grippers' decoded (angular) values of positions in [0, 1] lie in about
        # [−1.08, 0.95]: statistics there spread them over the normalised range (and pi0.5's
        # bins), so a gripper map done wrongly shows in the actions.
        for j in (6, 13):
            for k, v in dict(mean=-0.1, std=0.55, q01=-1.1, q99=1.0).items():
                state_stats[k][j] = v
    assets = out / "assets" / asset
    assets.mkdir(parents=True)
    (assets / "norm_stats.json").write_text(
        json.dumps({"norm_stats": {"state": state_stats, "actions": stats(actions)}})
    )
    return out


#: GR00T's test cameras: two (LeRobot stacks them, so of one size), brought to 64×64 in the graph.
GROOT_CAMERAS = {"observation.images.front": (3, 48, 64), "observation.images.wrist": (3, 48, 64)}


#: GR00T N1.7 at its real widths with an eighth of its layers (benches/lerobot_families.py):
#: Cosmos-Reason2-2B's LLM (width 2048, MLP 6144, 16 / 8 heads of 128) with 2 of the 16 layers
#: GR00T keeps, its ViT (width 1024, MLP 4096, 16 heads) with 3 of 24 layers, all three
#: deepstack; the action head at N1.7's sizes with 4 of 32 DiT blocks and 1 of 4 VL
#: self-attention blocks. The vocabulary stays the tests' (a lookup, whatever its size).
GROOT_REAL = {"llm": 2, "vit": 3, "dit": 4, "vlsa": 1}


def tiny_qwen3vl(out: Path, real: bool = False) -> Path:
    """A tiny Qwen3-VL as a local directory: a byte-level BPE tokenizer with Qwen's special
    tokens, a Qwen-style chat template (`<|im_start|>user\\n`, an image block per image, the
    text, `<|im_end|>\\n`), Qwen's image processor (16-px patches, merge 2, mean/std 0.5) and
    the model's config: what GR00T's VLM-encode step reads by `model_name`. `real`: the model
    at Cosmos-Reason2-2B's widths with `GROOT_REAL`'s layers."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    tok = _byte_level_bpe(special, [*TASKS, "user", "perform the task"])
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
        "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=template,
    )
    images = Qwen2VLImageProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=32 * 32,
        max_pixels=512 * 512,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    Qwen3VLProcessor(
        image_processor=images, tokenizer=fast, video_processor=video, chat_template=template
    ).save_pretrained(out)
    ids = {t: fast.convert_tokens_to_ids(t) for t in special}
    text: dict[str, object] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 5e6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2]},
    }
    vision: dict[str, object] = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        # Two deepstack layers over a backbone GR00T cuts to two: the first adds its features
        # in the middle, the second at the last kept layer, whose own output GR00T reads.
        "deepstack_visual_indexes": [0, 1],
        "num_position_embeddings": 64,
    }
    if real:
        text.update(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=GROOT_REAL["llm"],
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20]},
        )
        vision.update(
            depth=GROOT_REAL["vit"],
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            deepstack_visual_indexes=list(range(GROOT_REAL["vit"])),
            num_position_embeddings=2304,
            hidden_act="gelu_pytorch_tanh",
        )
    Qwen3VLConfig(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        text_config=text,
        vision_config=vision,
    ).save_pretrained(out)
    return out


def _groot_checkpoint_stats(base: Path, g: torch.Generator) -> dict[str, object]:
    """Isaac-GR00T's sidecars: `statistics.json` per embodiment and modality group, and the
    processor kwargs naming the groups (returned)."""
    import json

    groups = {"arm": 5, "gripper": 1}

    def entry(d: int) -> dict[str, list[float]]:
        mean = 3.0 * torch.randn(d, generator=g)
        half = 0.5 + 2.0 * torch.rand(d, generator=g)
        inner = 0.4 + 0.3 * torch.rand(d, generator=g)  # q01/q99 well inside min/max
        return {
            "min": (mean - half).tolist(),
            "max": (mean + half).tolist(),
            "q01": (mean - inner * half).tolist(),
            "q99": (mean + inner * half).tolist(),
            "mean": mean.tolist(),
            "std": (0.5 * half).tolist(),
        }

    stats = {
        "new_embodiment": {
            modality: {k: entry(d) for k, d in groups.items()} for modality in ("state", "action")
        }
    }
    (base / "statistics.json").write_text(json.dumps(stats))
    absolute = {"rep": "absolute", "type": "non_eef", "format": "default"}
    modality = {
        "state": {"modality_keys": list(groups), "delta_indices": [0]},
        "action": {
            "modality_keys": list(groups),
            "action_configs": [absolute, absolute],
            "delta_indices": list(range(6)),
        },
    }
    return {"use_percentiles": True, "modality_configs": {"new_embodiment": modality}}


def groot(
    root: Path,
    vlm: Path,
    seed: int = 0,
    checkpoint_stats: bool = False,
    real: bool = False,
    cameras: dict[str, tuple[int, int, int]] | None = None,
) -> Path:
    """A tiny GR00T N1.7 as LeRobot saves a fine-tune: a base model directory (config,
    weights, a processor_config.json with 64-px images and a 56-px crop) built with LeRobot's
    own `GR00TN17` over the tiny Qwen3-VL at `vlm`, then `GrootPolicy` over it with dataset
    statistics far from identity, saved with its processors (the VLM-encode step naming `vlm`).

    `checkpoint_stats`: the base is an Isaac-GR00T fine-tune carrying its own per-group
    statistics (`statistics.json`: q01/q99 away from min/max, `use_percentiles`) and modality
    config (state and action groups `arm` 5 + `gripper` 1, six valid action steps of eight),
    which LeRobot then uses instead of the dataset's (`GrootN17ActionDecodeStep`). `real`: N1.7's
    own sizes (132-wide state and actions, 40 steps, 256-px images) with `GROOT_REAL`'s layers,
    over a `tiny_qwen3vl(real=True)`; `cameras`: other camera shapes than `GROOT_CAMERAS`.
    The action head's output layer is scaled down so that most normalised actions fall inside
    [−1, 1] (the decode clips them) and scaled features up so the cameras and the prompt move
    the actions."""
    import json

    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import make_groot_pre_post_processors

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    base = root / "base"
    dims = 132 if real else 8
    horizon = 40 if real else 8
    if real:
        sizes: dict[str, object] = {
            "backbone_embedding_dim": 2048,
            "select_layer": GROOT_REAL["llm"],
            "hidden_size": 1024,
            "input_embedding_dim": 1536,
        }
        dit = {
            "num_layers": GROOT_REAL["dit"],
            "num_attention_heads": 32,
            "attention_head_dim": 48,
            "output_dim": 1024,
        }
        vlsa = {
            "num_layers": GROOT_REAL["vlsa"],
            "num_attention_heads": 32,
            "attention_head_dim": 64,
        }
    else:
        sizes = {
            "backbone_embedding_dim": 64,
            "select_layer": 2,
            "hidden_size": 32,
            "input_embedding_dim": 32,
        }
        dit = {
            "num_layers": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "output_dim": 32,
        }
        vlsa = {"num_layers": 1, "num_attention_heads": 4, "attention_head_dim": 16}
    cfg = GR00TN17Config(
        model_name=str(vlm),
        backbone_model_type="qwen",
        max_state_dim=dims,
        max_action_dim=dims,
        action_horizon=horizon,
        diffusion_model_cfg={
            "positional_embeddings": None,
            "norm_type": "ada_norm",
            "dropout": 0.2,
            "final_dropout": True,
            "interleave_self_attention": True,
            **dit,
        },
        vl_self_attention_cfg={
            "positional_embeddings": None,
            "dropout": 0.2,
            "final_dropout": True,
            **vlsa,
        },
        **sizes,
    )
    GR00TN17(cfg, load_backbone_weights=False).save_pretrained(base)
    kwargs: dict[str, object] = {"image_target_size": [64, 64], "image_crop_size": [56, 56]}
    if real:  # N1.7's own image sizes
        kwargs = {"image_target_size": [256, 256], "image_crop_size": [230, 230]}
    if checkpoint_stats:
        kwargs.update(_groot_checkpoint_stats(base, g))
    (base / "processor_config.json").write_text(json.dumps({"processor_kwargs": kwargs}))
    cams = cameras or GROOT_CAMERAS
    features = {k: PolicyFeature(FeatureType.VISUAL, s) for k, s in cams.items()}
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE,))
    pc = GrootConfig(
        base_model_path=str(base),
        max_state_dim=dims,
        max_action_dim=dims,
        chunk_size=horizon,
        n_action_steps=horizon,
        use_bf16=False,
        device="cpu",
        input_features=features,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION,))},
    )
    policy = GrootPolicy(pc)
    head = policy._groot_model.action_head
    # At the real widths these gains make the network chaotic (a 1e-6 change of the embedding
    # moved LeRobot's own actions by a quarter of their range): kept to the tiny model.
    with torch.no_grad():
        if not real:
            for block in head.vl_self_attention.transformer_blocks:
                for p in block.parameters():
                    p.mul_(4.0)
            # LeRobot's initialisation (0.02·randn per embodiment-specific layer) leaves the
            # velocity near 0 and the state unheard: actions would be the noise itself.
            for mlp in (head.action_decoder, head.state_encoder):
                mlp.layer1.W.mul_(10.0)
                mlp.layer2.W.mul_(10.0)
            policy._groot_model.backbone.language_model.embed_tokens.weight.mul_(50.0)
            for block in head.model.transformer_blocks:  # what the VL features and state reach
                block.attn1.to_v.weight.mul_(8.0)
                block.attn1.to_out[0].weight.mul_(4.0)
    pre, post = make_groot_pre_post_processors(
        pc, dataset_stats=_stats(g, {**features, **pc.output_features})
    )
    for step in pre.steps:
        if hasattr(step, "model_name"):
            step.model_name = str(vlm)
    out = root / "checkpoint"
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out
