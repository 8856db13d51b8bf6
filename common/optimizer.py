"""The job's optimizer: a ``torch.optim`` optimizer by name with its arguments, as the shards
(and all-reduce's ranks) build it, checked when the job is made.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wavelet.common.settings import ConfigError, check_settings, keyword_checked, positive, setting

# which parameters weight decay applies to: all (torch's default), or only those of two or more
# dimensions (the weights of linear and convolution layers; not biases or norm scales)
WEIGHT_DECAY_ON = ("all", "matrices")


def _optimizer_names() -> dict[str, str]:
    """Lower-case name -> class name of every optimizer in torch.optim."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name != "Optimizer":
            found[name.lower()] = name
    return found


_OPTIMIZERS = _optimizer_names()

# torch.optim's optimizers whose step cannot be a shard's update of gradients it was sent
UNSUPPORTED_OPTIMIZERS = {
    "lbfgs": "needs a closure that computes the loss again, which a shard cannot call",
    "sparseadam": "takes sparse gradients, and every mode here sends dense ones",
    "muon": "updates 2-D weight matrices whole, and shards hold tensors cut into flat chunks",
}


# Defaults per optimizer, under whatever the job's kwargs say: SGD trains with momentum 0.7
# unless told otherwise (momentum=0 gives plain SGD). Not the usual 0.9: staleness acts as
# implicit momentum ("asynchrony begets momentum", Mitliagkas et al. 2016), and measured on the
# default job (tick-tock, s = 1), 0.9 ended at 96.7-98.6% test accuracy over runs, 0.7 at 99.4%.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.7}}


@keyword_checked
@dataclass
class OptimizerConfig:
    """A ``torch.optim`` optimizer by name (case-insensitive) with its keyword arguments::

        opt = wavelet.OptimizerConfig(name="adamw", lr=1e-3, kwargs={"weight_decay": 0.01})
        job = wavelet.JobConfig(optimizer=opt)  # or optimizer="adamw", lr=1e-3

    Arguments the optimizer does not take are a ConfigError at once, with the optimizer's words.
    """

    name: str = setting("sgd", help="torch.optim optimizer by name, e.g. sgd, adam, adamw")
    lr: float = setting(0.05, help="learning rate (the schedule scales it over the job)")
    kwargs: dict[str, Any] = setting(
        default_factory=dict, help="the optimizer's other arguments, e.g. momentum", flag=""
    )
    weight_decay_on: str = setting(
        "all",
        help="all: weight decay on every parameter (torch's default); matrices: only on "
        "parameters of two or more dimensions, none on biases, norm scales and other 1-D "
        "ones (as nanoGPT and timm train transformers)",
        choices=WEIGHT_DECAY_ON,
        flag="--weight-decay-on",
    )

    def __post_init__(self) -> None:
        check_settings(self, "optimizer.")
        if self.name.lower() in UNSUPPORTED_OPTIMIZERS:
            raise ConfigError(
                f"optimizer {self.name!r} {UNSUPPORTED_OPTIMIZERS[self.name.lower()]}; choose "
                "another of torch.optim, e.g. sgd, adam, adamw"
            )
        if self.name.lower() not in _OPTIMIZERS:
            raise ConfigError(
                f"optimizer {self.name!r} is not in torch.optim; choose one of "
                + ", ".join(sorted(set(_OPTIMIZERS) - set(UNSUPPORTED_OPTIMIZERS)))
            )
        positive("optimizer.lr", self.lr)
        self._check_arguments()  # bad kwargs fail now, not on a shard
        decays = "weight_decay" in inspect.signature(self.optimizer_class).parameters
        if self.weight_decay_on != "all" and not decays:
            raise ConfigError(
                f"optimizer.weight_decay_on = {self.weight_decay_on!r}, but {self.name} has no "
                'weight decay: leave it "all" or choose an optimizer with one, e.g. adamw'
            )

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return getattr(torch.optim, _OPTIMIZERS[self.name.lower()])

    @property
    def effective_kwargs(self) -> dict[str, Any]:
        return {**OPTIMIZER_DEFAULTS.get(self.name.lower(), {}), **self.kwargs}

    def build(
        self, params: list[torch.Tensor], fused: bool = True, ndims: Sequence[int] | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer over ``params``; ``ndims``: each one's number of dimensions before any
        flattening (a shard's chunks are flat), which ``weight_decay_on`` needs."""
        cls = self.optimizer_class
        kwargs = self.effective_kwargs
        # The fused kernels update in one pass: 2x (SGD) to 4x (Adam) faster on a shard's chunks
        # (benchmarks/bench_ps.py). Used where the optimizer has one, unless the job says otherwise.
        has_fused = "fused" in inspect.signature(cls).parameters
        chosen = {"fused", "foreach"} & set(kwargs)
        if fused and has_fused and not chosen and all(p.is_floating_point() for p in params):
            kwargs = {**kwargs, "fused": True}
        groups = self._groups(params, ndims)
        try:
            return cls(groups, lr=self.lr, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"optimizer {self.name} rejected its arguments {kwargs}: {e}"
            ) from None

    def _groups(self, params: list[torch.Tensor], ndims: Sequence[int] | None) -> list:
        """``params`` as one group, or with ``weight_decay_on = "matrices"`` as two: those of two
        or more dimensions, and the rest without weight decay (an empty group is left out)."""
        if self.weight_decay_on == "all":
            return params
        if ndims is None or len(ndims) != len(params):
            raise ValueError("weight_decay_on needs every parameter's number of dimensions")
        decayed = [p for p, n in zip(params, ndims, strict=True) if n >= 2]
        spared = [p for p, n in zip(params, ndims, strict=True) if n < 2]
        groups = [{"params": decayed}, {"params": spared, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _check_arguments(self) -> None:
        """The optimizer's own checks of its arguments, without building one: a torch.optim
        class checks them in its ``__init__`` before handing over to ``Optimizer.__init__``,
        which imports torch._dynamo on first use (1.2 s per process here), so a subclass
        stops there. The launcher and the workers, which never step an optimizer, then never
        pay for that import."""
        cls = self.optimizer_class
        checked = type(f"Checked{cls.__name__}", (cls, _ArgumentsOnly), {})
        kwargs = self.effective_kwargs
        try:
            checked([torch.zeros(1, 1, requires_grad=True)], lr=self.lr, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"optimizer {self.name} rejected its arguments {kwargs}: {e}"
            ) from None
        except Exception:  # an __init__ that needs more of its base: build one after all
            self.build([torch.zeros(1, 1, requires_grad=True)])


class _ArgumentsOnly(torch.optim.Optimizer):
    """The base an optimizer's ``__init__`` reaches once it has checked its arguments: keeps
    what the rest of that ``__init__`` may read, and builds nothing."""

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        self.defaults = defaults
        self.param_groups = [{"params": list(params), **defaults}]
        self.state = collections.defaultdict(dict)


def optimizer_of(value: Any) -> OptimizerConfig:
    """``JobConfig(optimizer=...)``: a name, a table or an OptimizerConfig."""
    from wavelet.common.settings import from_dict

    if isinstance(value, OptimizerConfig):
        return value
    if isinstance(value, str):
        return OptimizerConfig(name=value)
    if isinstance(value, dict):
        return from_dict(OptimizerConfig, value, "optimizer.")
    raise ConfigError(
        f"optimizer must be a name (sgd, adamw, ...), a table or an OptimizerConfig, got "
        f"{type(value).__name__}"
    )
