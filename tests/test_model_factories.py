"""How a model factory is called: model_kwargs by keyword, the dataset's input_shape and
num_classes only where the factory takes them, unknown keys refused with the names it takes."""

import pytest
import torch
from torch import nn

from wavelet.common.models import build_model, factory_arguments

SHAPE, CLASSES = (1, 8, 8), 10


def torchvision_like(*, weights=None, progress=True, **kwargs):
    """torchvision.models.resnet18's signature: keyword-only, the rest to the model class."""
    return nn.Linear(4, kwargs.get("num_classes", 1000))


def named(num_classes=3, dropout=0.0):
    return nn.Sequential(nn.Dropout(dropout), nn.Linear(4, num_classes))


def positional(shape, classes, width=8):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(shape[1] * shape[2], width), nn.Linear(width, classes)
    )


def test_builtin_factories_get_shape_and_classes_by_name():
    args, kwargs = factory_arguments("mlp", build_model.__globals__["mlp"], SHAPE, CLASSES, {})
    assert args == () and kwargs == {"input_shape": SHAPE, "num_classes": CLASSES}


def test_a_keyword_only_factory_gets_only_the_jobs_kwargs():
    args, kwargs = factory_arguments("tv", torchvision_like, SHAPE, CLASSES, {"num_classes": 7})
    assert args == () and kwargs == {"num_classes": 7}


def test_a_factory_with_num_classes_gets_it_and_not_the_shape():
    args, kwargs = factory_arguments("n", named, SHAPE, CLASSES, {"dropout": 0.5})
    assert args == () and kwargs == {"dropout": 0.5, "num_classes": CLASSES}


def test_two_leading_positional_parameters_get_shape_and_classes():
    args, kwargs = factory_arguments("p", positional, SHAPE, CLASSES, {"width": 4})
    assert args == (SHAPE, CLASSES) and kwargs == {"width": 4}


def test_a_key_the_factory_does_not_take_is_refused_with_what_it_takes():
    with pytest.raises(TypeError, match=r"takes no 'widht'; it takes dropout, num_classes"):
        factory_arguments("n", named, SHAPE, CLASSES, {"widht": 4})


def test_classes_a_dataset_does_not_state_are_asked_for_not_passed_as_zero():
    """A map-style dataset without num_classes or classes says 0: a factory that needs the
    number is refused with what to set; one with a default of its own keeps it."""
    with pytest.raises(ValueError, match=r"model_kwargs.num_classes=N"):
        factory_arguments("p", positional, SHAPE, 0, {})
    with pytest.raises(ValueError, match=r"model_kwargs.num_classes=N"):
        factory_arguments("mlp", build_model.__globals__["mlp"], SHAPE, 0, {})
    assert factory_arguments("n", named, SHAPE, 0, {})[1] == {}


def test_build_model_by_import_path_with_user_kwargs():
    model = build_model("test_model_factories:torchvision_like", SHAPE, CLASSES, 0, num_classes=5)
    assert model(torch.zeros(2, 4)).shape == (2, 5)
    model = build_model("test_model_factories:named", SHAPE, CLASSES, 0)
    assert model(torch.zeros(2, 4)).shape == (2, CLASSES)


def test_torchvision_resnet18_by_import_path():
    pytest.importorskip("torchvision")
    model = build_model("torchvision.models:resnet18", (3, 32, 32), 10, 0, num_classes=10)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
