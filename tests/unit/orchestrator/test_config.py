"""Config: documented defaults, strict validation with one error naming the field, method
hyperparameters in ``[method_params]`` (flat keys and per-method tables), sweep series and
search-range overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dpsweep.core.datasets import POOLS
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import api, config
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.setup import describe_method
from dpsweep.trainables.methods import METHODS


def _load(tmp_path: Path, text: str) -> config.Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return api.load_config(p)


def _parse(text: str) -> config.Config:
    return api.from_dict(config.tomllib.loads(text))


# ---- defaults, round trip, documentation -----------------------------------------------------
def test_defaults_are_valid_and_round_trip(tmp_path: Path) -> None:
    cfg = config.Config()
    assert cfg.data.dataset == "digits" and cfg.training.method == "dpsgd"
    sizes = check(cfg).split_sizes
    assert sizes == {"train": 500, "validation": 200, "holdout": 300, "test": 297, "shadow": 500}
    assert sum(sizes.values()) == POOLS["digits"][0]  # all of it
    assert _load(tmp_path, cfg.to_toml()) == cfg
    assert _load(tmp_path, "") == cfg
    assert cfg.method_params == {} and cfg.search == {}
    assert not cfg.training.reproducible and not cfg.training.secure_mode


def test_a_full_config_round_trips_through_toml(tmp_path: Path) -> None:
    text = """
[privacy]
epsilon = 2.0
[budget]
epsilons = [8, 1, 2]
[training]
method = "lm_dpsgd"
preset = "paper"
reproducible = true
[sweep]
methods = ["lm_dpsgd:lagged", "dpsgd"]
sampler = "random"
[method_params]
lr = 0.3
[method_params.lm_dpsgd]
mode = "lagged"
lagged_beta = 0.8
[search.dpsgd]
clip_norm = {low = 0.5, high = 2.0, log = true}
"""
    cfg = _load(tmp_path, text)
    assert cfg.budget.epsilons == [1.0, 2.0, 8.0]  # sorted, as floats
    assert cfg.method_params == {"lr": 0.3, "lm_dpsgd": {"mode": "lagged", "lagged_beta": 0.8}}
    single = check(cfg).trial_params()  # the preset, then the config's values
    assert (single["mode"], single["lagged_beta"], single["r"], single["lr"]) == (
        "lagged", 0.8, 5.0, 0.3)
    assert cfg.search == {"dpsgd": {"clip_norm": {"low": 0.5, "high": 2.0, "log": True}}}
    assert _load(tmp_path, cfg.to_toml()) == cfg


def test_describe_documents_every_field() -> None:
    text = config.describe()
    blocks = {block.splitlines()[0]: block for block in text.split("\n\n") if block}
    for section, cls in config.SECTIONS.items():
        lines = blocks[f"[{section}]"].splitlines()
        for f in dataclasses.fields(cls):
            line = next(line for line in lines if line.startswith(f"{f.name} = "))
            assert f.metadata["doc"] in line, f"{section}.{f.name}"
    assert "[method_params]" in text
    # the documented defaults parse back to the default config
    assert api.from_dict(config.tomllib.loads(text)) == config.Config()


def test_describe_method_is_the_declaration_table() -> None:
    text = describe_method("lm_dpsgd")
    assert text.startswith("lm_dpsgd: ")
    assert "modes: public (valid); lagged (valid); faithful (epsilon claim invalid)" in text
    for p in METHODS["lm_dpsgd"].declaration():
        if p.role != "prepared":
            assert f"  {p.name} " in text, p.name
    assert "risk_meta" not in text  # filled by stage 1, not a hyperparameter
    assert "modes: lagged" in text  # lagged_beta says which mode reads it
    with pytest.raises(UserInputError) as err:
        describe_method("nope")
    assert err.value.field == "method"


def test_dataset_pools_hold_the_default_splits() -> None:
    """The torch-free dataset table (core/datasets.py) is true of the data: digits' pool is the
    loaded data's size, and every dataset's default splits fit its pool."""
    from dpsweep.core.datasets import POOLS
    from dpsweep.trainables.data.splits import DEFAULT_SIZES, available_size

    assert POOLS["digits"] == (available_size("digits").pool, 0)
    for name, (pool, test) in POOLS.items():
        sizes = DEFAULT_SIZES[name]
        private = sizes.train + sizes.validation + sizes.holdout + sizes.shadow
        assert private + (0 if test else sizes.test) <= pool, name
        assert sizes.test <= (test or pool), name


# ---- bad values: one error naming field, value and what is allowed -----------------------------
@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("[training]\nlrr = 0.1\n", "training.lrr", "unknown key"),
        ("[training]\nlr = 0.1\n", "training.lr", "unknown key"),  # moved to [method_params]
        ("[trainig]\nepochs = 1\n", "trainig", "unknown section"),
        ("[privacy]\nepsilon = -1\n", "privacy.epsilon", "(0, 100]"),
        ("[privacy]\nepsilon = 1e6\n", "privacy.epsilon", "(0, 100]"),
        ("[privacy]\nepsilon = nan\n", "privacy.epsilon", "finite"),
        ("[privacy]\nepsilon = inf\n", "privacy.epsilon", "finite"),
        ("[privacy]\nepsilon = 'three'\n", "privacy.epsilon", "a finite number"),
        ("[privacy]\ndelta = 1.5\n", "privacy.delta", "(0, 1)"),
        ("[privacy]\ndelta = 0.002\n", "privacy.delta", "1/train_size = 0.002"),
        ("[data]\ntrain_size = 100\n[privacy]\ndelta = 0.01\n", "privacy.delta", "0.01"),
        ("[privacy]\naccountant_timeout_s = 0.5\n", "privacy.accountant_timeout_s", "[1, 3600]"),
        ("[budget]\nepsilons = [1, 1]\n", "budget.epsilons", "distinct"),
        ("[budget]\nepsilons = [0, 1]\n", "budget.epsilons", "(0, 100]"),
        ("[budget]\nepsilons = 3\n", "budget.epsilons", "a list"),
        ("[training]\nepochs = 0\n", "training.epochs", "[1, 10000]"),
        ("[training]\nepochs = 2.5\n", "training.epochs", "an integer"),
        ("[training]\nepochs = true\n", "training.epochs", "an integer"),
        ("[training]\nreproducible = 1\n", "training.reproducible", "true or false"),
        ("[training]\nmethod = 'sgd'\n", "training.method", "dpsgd"),
        ("[training]\npreset = 'paper'\n", "training.preset", "a preset of dpsgd: none"),
        ("[training]\nbatch_size = 501\n", "training.batch_size", "train_size = 500"),
        ("[data]\ndataset = 'imagenet'\n", "data.dataset", "'fashion-mnist'"),
        ("[data]\ntrain_size = 1500\n", "data.sizes", "1797"),
        ("[data]\nvalidation_size = -1\n", "data.validation_size", ">= 0"),
        ("[data]\ndataset = 'fashion-mnist'\ntest_size = 20000\n", "data.test_size", "10000"),
        ("[data]\ndataset = 'fashion-mnist'\nshadow_size = 30000\n", "data.sizes", "60000"),
        ("[model]\nname = 'resnet'\n", "model.name", "'resnet20_gn'"),
        ("[resources]\ncpus_per_trial = true\n", "resources.cpus_per_trial", "an integer"),
        ("[sweep]\nsampler = 'cmaes'\n", "sweep.sampler", "'nsga2'"),
        ("[sweep]\nmethods = 'dpsgd'\n", "sweep.methods", "a list"),
        ("[sweep]\nmethods = ['x']\n", "sweep.methods", "a registered method"),
        ("[sweep]\nmethods = ['lm_dpsgd:nope']\n", "sweep.methods",
         "a mode of lm_dpsgd: public, lagged, faithful"),
        ("[sweep]\nmethods = ['dpsgd', 'dpsgd:standard']\n", "sweep.methods", "distinct"),
        ("[sweep]\nmethods = ['a:b:c']\n", "sweep.methods", "'method' or 'method:mode'"),
        ("data = 3\n", "data", "a table"),
        ("method_params = 3\n", "method_params", "a table"),
        ("[method_params]\nfoo = 1\n", "method_params.foo", "declared by"),
        ("[method_params]\nlr = 'x'\n", "method_params.lr", "(0, 100]"),
        ("[method_params]\nlr = true\n", "method_params.lr", "a finite number"),
        ("[method_params.nope]\nlr = 0.5\n", "method_params.nope", "named after a method"),
        ("[method_params.dpsgd]\nr = 2.0\n", "method_params.r", "a declared key"),
        ("[method_params.lm_dpsgd]\nlagged_beta = 0.5\n[sweep]\nmethods = ['lm_dpsgd']\n",
         "method_params.lagged_beta", "used only in mode lagged"),
        ("[method_params.dp_adamilg]\nalpha = 2.0\n", "method_params.alpha",
         "used only in mode faithful"),
        ("[sweep]\nmethods = ['dpsgd']\n[method_params]\nkappa = 0.2\n", "method_params.kappa",
         "declared by dpsgd"),
    ],
)
def test_bad_values_name_field_value_and_allowed(tmp_path: Path, text: str, field: str,
                                                  fragment: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _load(tmp_path, text)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field} = ")
    assert "is not allowed: expected " in str(exc.value)
    assert fragment in exc.value.allowed


@pytest.mark.parametrize(("text", "field"), [
    ("[search.dpsgd]\nclip_norm = {low = 2.0, high = 1.0}\n", "search.dpsgd.clip_norm.high"),
    ("[search.dpsgd]\nclip_norm = {low = 1.0, high = 1.0}\n", "search.dpsgd.clip_norm.high"),
    ("[search.dpsgd]\nclip_norm = {low = 1.0}\n", "search.dpsgd.clip_norm"),
    ("[search.dpsgd]\nclip_norm = {low = 0.5, high = 1.0, log = 'yes'}\n",
     "search.dpsgd.clip_norm.log"),
    ("[search.dpsgd]\nclip_norm = {choices = []}\n", "search.dpsgd.clip_norm.choices"),
    ("[search.dpsgd]\nclip_norm = [0.5, 1.0]\n", "search.dpsgd.clip_norm"),
    ("[search.dpsgd]\nkappa = {low = 0.1, high = 1.0}\n", "search.dpsgd.kappa"),
    ("[search.ww_dpsgd]\nkappa = {low = 0.1, high = 1.0}\n", "search.ww_dpsgd"),  # not swept
    ("[search]\ndpsgd = 3\n", "search.dpsgd"),
])
def test_bad_search_overrides(text: str, field: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _parse("[sweep]\nmethods = ['dpsgd']\n" + text)
    assert exc.value.field == field


@pytest.mark.parametrize("bounds", ["{low = 0.0, high = 1.0}", "{low = 1.0, high = 1e9}"])
def test_search_ranges_outside_the_declaration_are_refused(bounds: str) -> None:
    """clip_norm is declared in (0, 1e4]: a range reaching outside it cannot be searched."""
    with pytest.raises(UserInputError) as exc:
        _parse(f"[sweep]\nmethods = ['dpsgd']\n[search.dpsgd]\nclip_norm = {bounds}\n")
    assert exc.value.field.startswith("search.dpsgd.clip_norm")
    assert exc.value.allowed == "a finite number in (0, 10000]"


def test_valid_search_overrides_are_kept() -> None:
    cfg = _parse("[sweep]\nmethods = ['ww_dpsgd']\n[search.ww_dpsgd]\n"
                 "kappa = {low = 0.05, high = 0.5, log = true}\nK = {choices = [10, 50]}\n"
                 "lr_x_clip = {low = 0.2, high = 2.0}\n")
    assert cfg.search["ww_dpsgd"]["K"] == {"choices": [10, 50]}


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as exc:
        api.load_config(tmp_path / "missing.toml")
    assert exc.value.field == "CONFIG" and "an existing TOML file" in exc.value.allowed
    with pytest.raises(UserInputError, match="valid TOML"):
        _load(tmp_path, "[data\n")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserInputError, match="valid TOML"):
        api.load_config(tmp_path / "bin.toml")


def test_fashion_mnist_sizes_default_to_official_test_set(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "[data]\ndataset = 'fashion-mnist'\n")
    sizes = check(cfg).split_sizes
    assert sizes == {"train": 30000, "validation": 5000, "holdout": 10000, "test": 10000,
                     "shadow": 15000}
    assert sizes["train"] + 5000 + 10000 + 15000 == 60000


# ---- method hyperparameters ------------------------------------------------------------------
def test_flat_keys_apply_to_every_method_declaring_them() -> None:
    setup = check(_parse("[method_params]\nlr = 0.3\nclip_norm = 2.0\nr = 4.0\n"))
    assert setup.given_params("dpsgd") == {"lr": 0.3, "clip_norm": 2.0}  # dpsgd has no r
    assert setup.given_params("lm_dpsgd") == {"lr": 0.3, "clip_norm": 2.0, "r": 4.0}
    assert setup.given_params("dp_psac") == {"lr": 0.3, "clip_norm": 2.0, "r": 4.0}
    for method in METHODS:
        assert setup.trial_params(method)["lr"] == 0.3, method


def test_a_method_table_overrides_the_flat_keys_for_that_method_only() -> None:
    setup = check(_parse("[method_params]\nlr = 0.3\n[method_params.ww_dpsgd]\nlr = 0.05\n"
                           "K = 7\n"))
    assert setup.trial_params("ww_dpsgd")["lr"] == 0.05 and setup.trial_params("ww_dpsgd")["K"] == 7
    assert setup.trial_params("dpsgd")["lr"] == 0.3


def test_trial_params_start_from_the_preset_then_the_config_then_the_mode() -> None:
    setup = check(_parse("[training]\nmethod = 'lm_dpsgd'\npreset = 'paper'\n"
                           "[method_params.lm_dpsgd]\nr = 2.0\n"))
    p = setup.trial_params()
    assert (p["clip_norm"], p["er_eval"], p["r"], p["mode"]) == (1.0, "train", 2.0, "public")
    lagged = setup.trial_params("lm_dpsgd", mode="lagged", preset="")
    assert (lagged["mode"], lagged["er_eval"], lagged["r"]) == ("lagged", "heldout", 2.0)
    assert setup.trial_params("dpsgd") == METHODS["dpsgd"].validate_params({})


def test_mode_specific_keys_are_allowed_when_the_mode_reads_them() -> None:
    cfg = _parse("[sweep]\nmethods = ['lm_dpsgd:lagged']\n"
                 "[method_params.lm_dpsgd]\nlagged_beta = 0.8\n")
    assert check(cfg).trial_params("lm_dpsgd", mode="lagged")["lagged_beta"] == 0.8
    cfg = _parse("[sweep]\nmethods = ['dp_adamilg:faithful']\n[method_params]\nalpha = 2.0\n")
    assert check(cfg).trial_params("dp_adamilg", mode="faithful")["alpha"] == 2.0


def test_series_are_method_and_mode_pairs() -> None:
    cfg = _parse("[sweep]\nmethods = ['lm_dpsgd:lagged', 'dpsgd', 'lm_dpsgd']\n")
    assert check(cfg).series() == [("lm_dpsgd", "lagged"), ("dpsgd", "standard"),
                                     ("lm_dpsgd", "public")]
    everything = check(config.Config()).series()
    assert everything == [(name, cls.modes[0].name) for name, cls in METHODS.items()]
    assert {"auto_s", "dp_psac", "dpsgd", "dpsgd_lf", "lm_dpsgd", "ww_dpsgd",
            "dp_adamilg"} <= {m for m, _ in everything}


def test_user_input_errors_survive_pickling() -> None:
    """Config errors raised inside Ray workers reach the driver with their message intact."""
    import pickle

    with pytest.raises(UserInputError) as exc:
        _parse("[training]\nepochs = 0\n")
    again = pickle.loads(pickle.dumps(exc.value))
    assert type(again) is UserInputError
    assert (again.field, again.value, str(again)) == ("training.epochs", 0, str(exc.value))


# ---- issue 26: values no check may crash on, limits of the stages downstream ------------------
@pytest.mark.parametrize(("text", "field"), [
    ("[budget]\nepsilons = [[3]]\n", "budget.epsilons"),
    ("[budget]\nepsilons = [{a = 1}]\n", "budget.epsilons"),
    ("[budget]\nepsilons = [1, 1.0]\n", "budget.epsilons"),  # equal once numbers
    ("[budget]\nepsilons = ['inf']\n", "budget.epsilons"),
    ("[data]\nmean = [[1.0]]\n", "data.mean"),
    ("[data]\nfeature_columns = [{a = 'x'}]\n", "data.feature_columns"),
    ("[model]\nlayers = [['body']]\n", "model.layers"),
    ("[sweep]\nmethods = [['dpsgd']]\n", "sweep.methods"),
    ("[sweep]\nmethods = [{a = 1}]\n", "sweep.methods"),
    ("[sweep]\nmethods = ['dpsgd:']\n", "sweep.methods"),
    ("[privacy]\nepsilon = [3]\n", "privacy.epsilon"),
    ("[privacy]\nepsilon = {a = 3}\n", "privacy.epsilon"),
    ("[training]\nepochs = [[1]]\n", "training.epochs"),
    (f"[privacy]\nepsilon = 1{'0' * 400}\n", "privacy.epsilon"),
    (f"[budget]\nepsilons = [1{'0' * 400}]\n", "budget.epsilons"),
    ("[data]\nsplit_seed = 9223372036854775808\n", "data.split_seed"),  # 2^63
    ("[data]\nsplit_seed = -9223372036854775809\n", "data.split_seed"),
    ("[training]\nseed = 9223372036854775807\n", "training.seed"),  # re-runs add to it
    ("[sweep]\nseed = 2147483648\n", "sweep.seed"),
    ("[audit]\nseed = 18446744073709551616\n", "audit.seed"),
    ("[model]\nargs = {width = 100000000000000000000}\n", "model.args.width"),
    ("[method_params]\nlr = 100000000000000000000\n", "method_params.lr"),
    ("[model]\nargs = {when = 1979-05-27}\n", "model.args.when"),
    ("[budget]\nepsilons = [07:32:00]\n", "budget.epsilons"),
])
def test_malformed_values_are_refused_by_name_never_crash(tmp_path: Path, text: str,
                                                          field: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _load(tmp_path, text)
    assert exc.value.field == field
    assert len(str(exc.value).splitlines()) == 1


def test_an_integer_too_long_to_print_is_refused_as_a_config_error(tmp_path: Path) -> None:
    """tomllib cannot even convert 5,000 digits (Python's int-string limit): still one error."""
    with pytest.raises(UserInputError) as exc:
        _load(tmp_path, f"[privacy]\nepsilon = {'9' * 5000}\n")
    assert exc.value.field == "CONFIG" and "valid TOML" in exc.value.allowed
    with pytest.raises(UserInputError) as exc:
        api.from_dict({"privacy": {"epsilon": 10**5000}})
    assert exc.value.field == "privacy.epsilon" and "bits" in str(exc.value.value)


def test_a_config_path_the_system_cannot_take_is_a_config_error() -> None:
    with pytest.raises(UserInputError) as exc:
        api.load_config("c" * 300 + ".toml")
    assert exc.value.field == "CONFIG" and "at most 255 bytes" in exc.value.allowed


def test_seeds_inside_their_ranges_are_kept() -> None:
    cfg = _parse(f"[data]\nsplit_seed = {config.MAX_SEED}\n[sweep]\nseed = "
                 f"{config.MAX_SWEEP_SEED}\n[audit]\nseed = {config.MAX_SEED}\n")
    assert (cfg.data.split_seed, cfg.sweep.seed) == (config.MAX_SEED, config.MAX_SWEEP_SEED)


def test_the_epsilon_floor_is_the_accountants_rdp_bound_with_infinite_noise() -> None:
    """Config validation's floor is what orchestrator.accounting.prv's conversion gives for
    zero RDP (infinite noise), at the same orders."""
    import numpy as np

    from dpsweep.orchestrator.accounting.prv import DOMAIN_RDP_MAX_ORDER, rdp_to_epsilon
    from dpsweep.orchestrator.config.checks import RDP_MAX_ORDER, epsilon_floor

    assert DOMAIN_RDP_MAX_ORDER == RDP_MAX_ORDER
    for delta in (1e-3, 1e-5, 1e-9, 1e-15):
        zero = np.zeros(RDP_MAX_ORDER - 1)
        assert epsilon_floor(delta) == pytest.approx(rdp_to_epsilon(zero, delta), rel=1e-12)


@pytest.mark.parametrize(("text", "field", "fragment"), [
    ("[privacy]\nepsilon = 1e-9\n", "privacy.epsilon", "never certifies less"),
    ("[privacy]\nepsilon = 0.04\n", "privacy.epsilon", "[0.0455, 100]"),
    ("[privacy]\ndelta = 5e-324\n", "privacy.delta", "a number >= 1.6e-13 for 160 training"),
    ("[privacy]\ndelta = 1e-100\n", "privacy.delta", "float64 rounding"),
    ("[privacy]\ndelta = 1e-12\n[training]\nepochs = 2000\n", "privacy.delta",
     "a number >= 1.6e-11 for 16000 training steps"),
    ("[budget]\nepsilons = [0.01, 3]\n", "budget.epsilons", "0.01 is below"),
    ("[privacy]\ndelta = 1e-12\n[training]\nepochs = 2000\n[budget]\nepsilons = [1, 3]\n",
     "privacy.delta", "a number >= 1.6e-11 for 16000 training steps"),
])
def test_targets_the_accountant_cannot_certify_are_refused(text: str, field: str,
                                                           fragment: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _parse(text)
    assert exc.value.field == field
    assert fragment in exc.value.allowed


def test_privacy_epsilon_is_not_checked_when_budget_epsilons_replaces_it() -> None:
    """With ``budget.epsilons`` set no trial trains at ``privacy.epsilon``: an unreachable value
    there must not refuse a config whose targets are all reachable."""
    cfg = _parse("[privacy]\nepsilon = 1e-9\n[budget]\nepsilons = [1, 3]\n")
    assert cfg.targets() == [1.0, 3.0]


def test_the_smallest_accepted_delta_is_accepted() -> None:
    cfg = _parse("[privacy]\ndelta = 1.6e-13\n")  # 20 epochs of 8 batches
    assert cfg.privacy.delta == 1.6e-13


def test_the_smallest_accepted_target_is_accepted_and_calibrates() -> None:
    """The number the message quotes is itself accepted, and the accountant reaches it."""
    from dpsweep.orchestrator.accounting.calibration import calibrate
    from dpsweep.orchestrator.config.checks import smallest_epsilon

    low = smallest_epsilon(1e-5)
    cfg = _parse(f"[privacy]\nepsilon = {low!r}\n")
    assert cfg.privacy.epsilon == low
    cal = calibrate(target_epsilon=low, delta=1e-5, sample_rate=0.125, steps=160,
                    use_cache=False)
    assert 0.99 * low <= cal.bounds.upper <= low


def test_validation_needs_enough_examples_to_tell_a_trial_from_chance(tmp_path: Path) -> None:
    from dpsweep.orchestrator.config.checks import DEGENERATE_MARGIN, min_validation_size
    from dpsweep.reports.store import DEGENERATE_MARGIN as STORE_MARGIN

    assert DEGENERATE_MARGIN == STORE_MARGIN
    assert (min_validation_size(10), min_validation_size(2)) == (35, 97)
    with pytest.raises(UserInputError) as exc:
        _load(tmp_path, "[data]\nvalidation_size = 34\n")
    assert exc.value.field == "data.validation_size" and "at least 35" in exc.value.allowed
    enough = check(_load(tmp_path, "[data]\nvalidation_size = 35\n"))
    assert enough.split_sizes["validation"] == 35


@pytest.mark.parametrize(("text", "field", "fragment"), [
    ("[method_params]\nclip_norm = 3.0\n[search.dpsgd]\nclip_norm = {low = 0.2, high = 2.0}\n",
     "search.dpsgd.clip_norm", "method_params.clip_norm = 3.0 fixes clip_norm"),
    ("[method_params.dpsgd]\nclip_norm = 1.0\n[search.dpsgd]\nclip_norm = {low = 0.2, "
     "high = 2.0}\n", "search.dpsgd.clip_norm", "method_params.dpsgd.clip_norm = 1.0"),
    ("[method_params]\nlr = 0.5\n[search.dpsgd]\nlr_x_clip = {low = 0.5, high = 1.0}\n",
     "search.dpsgd.lr_x_clip", "fixes lr"),
    ("[search.dpsgd]\nclip_norm = {choices = [1.0, 1.0]}\n", "search.dpsgd.clip_norm.choices",
     "distinct"),
    ("[search.dpsgd]\nclip_norm = {low = 'a', high = 2.0}\n", "search.dpsgd.clip_norm.low",
     "a finite number"),
])
def test_search_ranges_a_sweep_would_ignore_are_refused(text: str, field: str,
                                                        fragment: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _parse("[sweep]\nmethods = ['dpsgd']\n" + text)
    assert exc.value.field == field
    assert fragment in exc.value.allowed


def test_a_range_for_a_mode_only_another_series_reads_is_kept() -> None:
    cfg = _parse("[sweep]\nmethods = ['lm_dpsgd:public', 'lm_dpsgd:lagged']\n[search.lm_dpsgd]\n"
                 "lagged_beta = {low = 0.1, high = 0.9}\n")
    assert "lagged_beta" in cfg.search["lm_dpsgd"]
    with pytest.raises(UserInputError, match="read only in mode lagged"):
        _parse("[sweep]\nmethods = ['lm_dpsgd:public']\n[search.lm_dpsgd]\n"
               "lagged_beta = {low = 0.1, high = 0.9}\n")
