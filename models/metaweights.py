"""Seeded weights of a model built on the meta device, produced one tensor at a time.

The in-RAM builders seed torch (:func:`models.seeding.seed_everything`), construct the model, whose
modules draw their default initialisation from torch's global generator in construction order, and
then perturb the constant parameters (:func:`models.seeding.perturb_constant_parameters`).  A
full-size Flux-dev built that way is 24 GB in bfloat16.

:func:`build_on_meta` constructs the same model on the meta device (no storage, no random numbers)
while a ``TorchFunctionMode`` records every initialisation call made on a parameter
(``kaiming_uniform_``, ``uniform_``, ``fill_``, ...).  :class:`SeededWeights` replays them, a
parameter at a time, on real tensors: before each random call it restores the global generator's
state that call saw in the in-RAM build (states are found by replaying the calls in order, on a
scratch tensor when the parameter itself is not asked for), then applies the same perturbation.
A parameter materialised here is bit-identical to the in-RAM build's, and asking for the
parameters in construction order draws each random number once.

Contracts:
* What the recorder cannot replay is refused when the model is built, never guessed: a random
  call on a tensor that is not (yet) a parameter, an explicit ``generator=``, another tensor as an
  argument, a parameter no call initialised, buffers.
* A parameter initialised only by fills (norm weights, zero biases) is perturbed exactly as
  ``perturb_constant_parameters`` does (sorted names, its own generator).  One drawn at random is
  taken to be non-constant and checked when it is materialised.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .seeding import DEFAULT_SEED, PERTURB_SEED_OFFSET, is_constant, perturb_constant

# In-place initialisations that draw from the generator, and those that do not.
RANDOM_INITS = frozenset({
    "uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_", "exponential_", "geometric_",
    "cauchy_", "log_normal_"})
FIXED_INITS = frozenset({"fill_", "zero_", "ones_", "zeros_", "constant_"})
# Functions that draw from the generator to make a new tensor (refused: a parameter made from one
# cannot be traced back to the call).
RANDOM_FACTORIES = frozenset({
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
    "randn_like", "randint_like"})


@dataclass
class InitCall:
    """One recorded initialisation: ``func(target, *args, **kwargs)``."""

    func: object
    args: tuple
    kwargs: dict
    random: bool

    def apply(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            if "tensor" in self.kwargs:
                self.func(*self.args, **dict(self.kwargs, tensor=tensor))
            else:
                self.func(tensor, *self.args, **self.kwargs)


class _InitRecorder(TorchFunctionMode):
    """Records initialisation calls made while a model is constructed on the meta device."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor | None, InitCall]] = []
        self.refused: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in RANDOM_INITS or name in FIXED_INITS:
            if "tensor" in kwargs:
                target, rest = kwargs["tensor"], args
            else:
                target, rest = (args[0], args[1:]) if args else (None, ())
            others = [a for a in list(rest) + [v for k, v in kwargs.items() if k != "tensor"]
                      if isinstance(a, torch.Tensor)]
            if kwargs.get("generator") is not None or others:
                self.refused.append(f"{name} with a generator or tensor argument")
            self.calls.append((target, InitCall(func, tuple(rest), dict(kwargs), name in RANDOM_INITS)))
        elif name in RANDOM_FACTORIES:
            self.refused.append(f"torch.{name} (random numbers outside a parameter's initialisation)")
        return func(*args, **kwargs)


def build_on_meta(construct, dtype=None, seed: int = DEFAULT_SEED):
    """``construct()`` on the meta device, in ``dtype``; returns ``(module, calls)`` where ``calls`` is the
    recorded initialisation, in order, as ``(parameter, InitCall)``.  Bind it to parameter names with
    :meth:`SeededWeights.bind` once the module is wrapped."""
    from .base import default_dtype

    recorder = _InitRecorder()
    with torch.device("meta"), default_dtype(dtype), recorder:
        module = construct()
    if recorder.refused:
        raise NotImplementedError(f"cannot replay this model's initialisation one tensor at a time: "
                                  f"{recorder.refused[0]}")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module, recorder.calls


@dataclass
class _Param:
    name: str
    shape: tuple
    dtype: torch.dtype
    calls: list = field(default_factory=list)   # indexes into SeededWeights.calls
    noise_state: torch.Tensor | None = None      # perturbation generator state (fill-only, constant)


class SeededWeights:
    """The seeded parameters of a meta-built module, materialised on demand (see the module doc)."""

    def __init__(self, module: torch.nn.Module, calls, seed: int = DEFAULT_SEED):
        if any(True for _ in module.buffers()):
            raise NotImplementedError("cannot stream a model with buffers (only parameters are replayed)")
        by_id = {id(p): name for name, p in module.named_parameters()}
        self.params = {name: _Param(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()}
        self.calls: list[tuple[str, InitCall]] = []
        for target, call in calls:
            name = by_id.get(id(target))
            if name is None:
                if call.random:
                    raise NotImplementedError(f"cannot replay this model's initialisation: {call.func.__name__} "
                                              f"draws for a tensor that is not one of its parameters")
                continue
            self.params[name].calls.append(len(self.calls))
            self.calls.append((name, call))
        missing = [n for n, p in self.params.items() if not p.calls]
        if missing:
            raise NotImplementedError(f"no recorded initialisation for {missing[0]}")
        self._random = [i for i, (_, c) in enumerate(self.calls) if c.random]
        torch.manual_seed(seed)  # as seed_everything does before the in-RAM build
        # generator state before each random call, found by replaying them in order
        self._states: dict[int, torch.Tensor] = {self._random[0]: torch.get_rng_state()} if self._random else {}
        self._plan_perturbation(seed)

    def _plan_perturbation(self, seed: int) -> None:
        """perturb_constant_parameters' draws, in its order: the fill-only parameters that come out
        constant (cheap to materialise: no random numbers) get the generator state of their noise."""
        gen = torch.Generator().manual_seed(seed + PERTURB_SEED_OFFSET)
        for name in sorted(self.params):
            p = self.params[name]
            if not p.dtype.is_floating_point or any(self.calls[i][1].random for i in p.calls):
                continue
            if is_constant(self._initialised(p)):
                p.noise_state = gen.get_state()
                torch.randn(p.shape, generator=gen, dtype=torch.float32)  # advance past its noise

    def _state_before(self, index: int) -> torch.Tensor:
        """The global generator's state before random call ``index`` in the in-RAM build."""
        known = max(i for i in self._states if i <= index)
        while known != index:  # replay the random calls in between on scratch tensors
            name, call = self.calls[known]
            torch.set_rng_state(self._states[known])
            call.apply(torch.empty(self.params[name].shape, dtype=self.params[name].dtype))
            known = self._random[self._random.index(known) + 1]
            self._states[known] = torch.get_rng_state()
        return self._states[index]

    def _initialised(self, p: _Param) -> torch.Tensor:
        tensor = torch.empty(p.shape, dtype=p.dtype)
        for i in p.calls:
            call = self.calls[i][1]
            if call.random:
                torch.set_rng_state(self._state_before(i))
            call.apply(tensor)
            if call.random:  # the next random call's state comes for free
                pos = self._random.index(i)
                if pos + 1 < len(self._random):
                    self._states.setdefault(self._random[pos + 1], torch.get_rng_state())
        return tensor

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter ``name``, as the in-RAM seeded build holds it."""
        p = self.params[name]
        tensor = self._initialised(p)
        if p.noise_state is not None:
            gen = torch.Generator()
            gen.set_state(p.noise_state)
            perturb_constant(tensor, torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))
        elif p.dtype.is_floating_point and is_constant(tensor):
            raise AssertionError(f"{name} came out constant from a random initialisation: "
                                 f"the in-RAM build would have perturbed it")
        return tensor

    def names_in_order(self) -> list[str]:
        """Parameter names in the order their initialisation draws (the order that draws each number once)."""
        seen = []
        for name, _ in self.calls:
            if name not in seen:
                seen.append(name)
        return seen
