"""The layer-wise membership risk of an architecture: LM-DP-SGD's stage 1
(``trainables.methods.lm_dpsgd``), on public data only and cached on disk.

A shadow model of the trial's architecture is trained non-privately on half of the public
shadow pool; one membership attack per layer (:mod:`trainables.audit.layer_attack`) is fitted
on its IRs of members and non-members, and the attack's balanced error rate ER(l) is the
layer's risk. It lives with the attacks because it needs scikit-learn: the method module
imports it only when stage 1 runs, so ``dpsweep config --check`` reads the method's declaration
without it; the estimate's hyperparameters and the smallest usable shadow pool, which the
method validates, are :mod:`trainables.audit.risk_stage`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from dpsweep.core.errors import UserInputError
from dpsweep.core.hints import ignored
from dpsweep.core.storage import JsonCache
from dpsweep.trainables.audit.layer_attack import (
    fit_layer_attacks,
    ir_features,
    layer_accuracies,
    split_features,
)
from dpsweep.trainables.audit.risk_stage import MIN_STAGE1_EXAMPLES, Stage1
from dpsweep.trainables.dp.optim import Update

if TYPE_CHECKING:
    from dpsweep.trainables.models.networks import LayeredModel

CACHE_VERSION = 1


def risk_identity(*, data: Any, model: LayeredModel, seed: int,
                  stage1: Stage1) -> dict[str, Any]:
    """What the risk vector depends on. The shadow indices are hashed because the shadow pool
    is cut after train and holdout: the same split seed and size with other split sizes is a
    different pool."""
    indices = np.ascontiguousarray(np.asarray(data.shadow.indices, dtype=np.int64))
    return {
        "version": CACHE_VERSION,
        "architecture": repr(model),
        "layers": list(model.layer_names),
        "dataset": str(data.name),
        "split_seed": int(data.seed),
        "shadow_size": len(data.shadow),
        "shadow_indices_sha256": hashlib.sha256(indices.tobytes()).hexdigest(),
        "seed": int(seed),
        "stage1": asdict(stage1),
    }


#: Namespace of the risk vectors in the sweep's cache directory.
CACHE_NAMESPACE = "lm_dpsgd_risk"


def _accuracy(model: LayeredModel, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).double().mean())


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run on one CPU thread (torch and the BLAS under scikit-learn), then restore.

    A small CNN at batch 128 gains little from a second thread, while an oversubscribed
    machine (parallel trials) slows a multi-threaded loop several-fold; and floating-point
    sums, hence the risk vector, then do not depend on the caller's thread count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)


def compute_layer_risk(*, data: Any, model_factory: Callable[[], LayeredModel], seed: int,
                       stage1: Stage1) -> dict[str, Any]:
    """Stage 1 proper (no cache): shadow model, per-layer attacks, ER per layer.

    Deterministic for a seed, whatever the caller's RNG state and thread count: torch's
    global RNG is forked (the caller's is untouched), model init and batches come from seeds
    derived from ``seed``, and it runs on one thread.
    """
    with _one_thread():
        return _compute_layer_risk(data=data, model_factory=model_factory, seed=seed,
                                   stage1=stage1)


def _compute_layer_risk(*, data: Any, model_factory: Callable[[], LayeredModel], seed: int,
                        stage1: Stage1) -> dict[str, Any]:
    s_split, s_init, s_batch, s_attack = (
        int(v) for v in np.random.SeedSequence([seed, 0x4C4D]).generate_state(4))
    x_all, y_all = data.shadow.x.cpu(), data.shadow.y.cpu()
    n = len(x_all) if stage1.examples == 0 else min(stage1.examples, len(x_all))
    if n < MIN_STAGE1_EXAMPLES:
        raise UserInputError(field="method_params.stage1_examples", value=stage1.examples,
                             allowed=f"0 or >= {MIN_STAGE1_EXAMPLES}, with a shadow pool of "
                                     f">= {MIN_STAGE1_EXAMPLES} examples "
                                     f"(it has {len(x_all)}) for lm_dpsgd's risk estimate")
    order = torch.from_numpy(np.random.default_rng(s_split).permutation(len(x_all))[:n])
    half = n // 2
    x_in, y_in = x_all[order[:half]], y_all[order[:half]]
    x_out, y_out = x_all[order[half:]], y_all[order[half:]]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s_init)
        model = model_factory().cpu()
    model.train()
    gen = torch.Generator().manual_seed(s_batch)
    opt = Update(model.named_parameters(), kind="adam", lr=stage1.lr)
    for _ in range(stage1.steps):
        idx = torch.randint(0, half, (min(stage1.batch_size, half),), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x_in[idx]), y_in[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    # sorted features: class-agnostic confidence profiles (layer_attack's docstring)
    f_in = ir_features(model, x_in, sort_units=True)
    f_out = ir_features(model, x_out, sort_units=True)
    if stage1.er_eval == "heldout":
        rng = np.random.default_rng(s_attack)
        fit_in, eval_in = split_features(f_in, fraction=0.5, rng=rng)
        fit_out, eval_out = split_features(f_out, fraction=0.5, rng=rng)
    else:
        fit_in, eval_in, fit_out, eval_out = f_in, f_in, f_out, f_out
    attacks = fit_layer_attacks(fit_in, fit_out, seed=s_attack % 2**31, kind=stage1.attack)
    acc_eval = layer_accuracies(attacks, eval_in, eval_out)
    acc_fit = layer_accuracies(attacks, fit_in, fit_out)
    names = model.layer_names
    return {
        "risk": [1.0 - acc_eval[name] for name in names],
        "risk_meta": {
            "layers": list(names),
            "er_eval": stage1.er_eval,
            "members": half,
            "nonmembers": n - half,
            "attack_eval_examples": len(next(iter(eval_in.values())))
                                    + len(next(iter(eval_out.values()))),
            "shadow_train_accuracy": _accuracy(model, x_in, y_in),
            "shadow_test_accuracy": _accuracy(model, x_out, y_out),
            "attack_accuracy": [acc_eval[name] for name in names],
            "attack_fit_accuracy": [acc_fit[name] for name in names],
        },
    }


def _well_formed(result: Any, *, layers: int) -> bool:
    """Whether a cached stage-1 result has the form :func:`compute_layer_risk` gives: one
    finite error rate in [0, 1] per layer and a dict of facts."""
    if not isinstance(result, dict) or not isinstance(result.get("risk_meta"), dict):
        return False
    risk = result.get("risk")
    return isinstance(risk, list) and len(risk) == layers and all(
        isinstance(r, int | float) and not isinstance(r, bool) and 0.0 <= r <= 1.0
        for r in risk)


def estimate_layer_risk(*, data: Any, model_factory: Callable[[], LayeredModel], seed: int,
                        stage1: Stage1, cache_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Stage 1 through the on-disk cache: {"risk": [ER per layer], "risk_meta": {...}}.

    The result is a pure function of its identity (no timings), so a recomputation after the
    cache was wiped yields the same trial spec, and a resumed trial still matches its
    checkpoint. Concurrent trials may both compute; the atomic replace makes either win.
    """
    with torch.random.fork_rng(devices=[]):
        probe = model_factory()
    identity = risk_identity(data=data, model=probe, seed=seed, stage1=stage1)
    cache = JsonCache(cache_dir, CACHE_NAMESPACE)
    result = cache.get(identity)
    if result is not None and not _well_formed(result, layers=len(probe.layer_names)):
        ignored(cache.path(identity), "not a risk vector of this model's layers")
        result = None
    if result is None:
        result = compute_layer_risk(data=data, model_factory=model_factory, seed=seed,
                                    stage1=stage1)
        cache.put(identity, result)
    compact = {k: v for k, v in identity.items() if k != "architecture"}
    compact["architecture_sha256"] = hashlib.sha256(identity["architecture"].encode()).hexdigest()
    meta = {**result["risk_meta"], "identity": compact, "cache_file": cache.path(identity).name}
    return {"risk": list(result["risk"]), "risk_meta": meta}
