"""Switch parsing: valid combinations, and every malformed value named with what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from qsa_sglang_plugin import Feature, HiSparseMode, SwitchError, Switches, parse_switches
from qsa_sglang_plugin._activation import activate
from qsa_sglang_plugin._switches import (
    MAX_PREFIX_CACHE_ENTRIES,
    MAX_PREFIX_CACHE_MB,
    current_switches,
)

ON = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}


def _assert_refused(env: dict[str, str], fragments: list[str]) -> None:
    """``parse_switches(env)`` raises ``SwitchError`` whose message holds every fragment."""
    with pytest.raises(SwitchError) as info:
        parse_switches(env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_no_switch_means_no_feature() -> None:
    """Unset and empty values parse to an all-off Switches with no features."""
    for env in ({}, {"SGLANG_QSA_MODEL_COMPAT": "", "SGLANG_QSA_HISPARSE_V3": ""}):
        switches = parse_switches(env)
        assert switches == Switches()
        assert not switches.any_on
        assert switches.features == ()


def test_model_compat_zero_is_off() -> None:
    """SGLANG_QSA_MODEL_COMPAT=0 is a valid way to say off."""
    assert not parse_switches({"SGLANG_QSA_MODEL_COMPAT": "0"}).any_on


@pytest.mark.parametrize("mode", list(HiSparseMode))
def test_every_mode_with_model_compat_parses(mode: HiSparseMode) -> None:
    """Both V3 modes parse when MODEL_COMPAT=1 and turn on the hisparse feature and the request
    lifecycle (the qsa_hisparse tree cache); only p2-offload offloads, through the plugin's QSA
    backend and the one-page K/V pool."""
    switches = parse_switches({"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": mode})
    assert switches.hisparse is mode
    assert switches.offload is (mode is HiSparseMode.P2_OFFLOAD)
    offload = (Feature.QSA_BACKEND, Feature.KV_POOL) if switches.offload else ()
    assert switches.features == (
        Feature.FRAMEWORK,
        Feature.MODEL_COMPAT,
        Feature.HISPARSE,
        Feature.LIFECYCLE,
        *offload,
    )


def test_prefix_cache_budget_and_entries_parse() -> None:
    """MB and max entries parse to integers; the budget in bytes is MiB * 2**20."""
    switches = parse_switches(
        {
            **ON,
            "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "8192",
            "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES": "7",
        }
    )
    assert switches.prefix_cache_mb == 8192
    assert switches.prefix_cache_bytes == 8192 * 1048576
    assert switches.prefix_cache_max_entries == 7
    assert Feature.PREFIX_CACHE in switches.features


def test_verification_is_off_unless_asked_for_with_offload() -> None:
    assert not parse_switches(ON).verify_offload
    assert parse_switches({**ON, "SGLANG_QSA_HISPARSE_VERIFY": "1"}).verify_offload


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"SGLANG_QSA_MODEL_COMPAT": "yes"}, ["SGLANG_QSA_MODEL_COMPAT='yes'", "'0', '1'"]),
        ({"SGLANG_QSA_MODEL_COMPAT": " 1"}, ["SGLANG_QSA_MODEL_COMPAT=' 1'"]),
        (
            {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "offload"},
            ["SGLANG_QSA_HISPARSE_V3='offload'", "'p2-offload', 'p2-resident'"],
        ),
        (
            {"SGLANG_QSA_HISPARSE_V3": "p2-offload"},
            ["requires SGLANG_QSA_MODEL_COMPAT='1'", "SGLANG_QSA_MODEL_COMPAT=''"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "-1"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB='-1'", "0 (off) or a positive integer"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "1.5"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB='1.5'"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES": "0"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES='0'", "a positive integer"],
        ),
        (
            {"SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB='64' requires SGLANG_QSA_HISPARSE_V3"],
        ),
        (
            {
                "SGLANG_QSA_MODEL_COMPAT": "1",
                "SGLANG_QSA_HISPARSE_V3": "p2-resident",
                "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64",
            },
            [
                "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB='64' requires "
                "SGLANG_QSA_HISPARSE_V3='p2-offload'",
                "got SGLANG_QSA_HISPARSE_V3='p2-resident'",
            ],
        ),
        ({**ON, "SGLANG_QSA_HISPARSE_VERIFY": "on"}, ["SGLANG_QSA_HISPARSE_VERIFY='on'", "'1'"]),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-resident", "SGLANG_QSA_HISPARSE_VERIFY": "1"},
            [
                "requires SGLANG_QSA_HISPARSE_V3='p2-offload'",
                "got SGLANG_QSA_HISPARSE_V3='p2-resident'",
            ],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-offload", "SGLANG_QSA_CACHE_SHARDING": "0"},
            ["SGLANG_QSA_CACHE_SHARDING='0'", "a positive integer up to 64"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-offload", "SGLANG_QSA_CACHE_SHARDING": "65"},
            ["SGLANG_QSA_CACHE_SHARDING='65'", "up to 64"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-offload", "SGLANG_QSA_HISPARSE_HOT_BLOCKS": "0"},
            ["SGLANG_QSA_HISPARSE_HOT_BLOCKS='0'", "a positive integer up to 16777216"],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-resident", "SGLANG_QSA_HISPARSE_HOT_BLOCKS": "9"},
            [
                "SGLANG_QSA_HISPARSE_HOT_BLOCKS='9' requires SGLANG_QSA_HISPARSE_V3='p2-offload'",
                "got SGLANG_QSA_HISPARSE_V3='p2-resident'",
            ],
        ),
        (
            {**ON, "SGLANG_QSA_HISPARSE_V3": "p2-resident", "SGLANG_QSA_CACHE_SHARDING": "2"},
            [
                "SGLANG_QSA_CACHE_SHARDING='2' shards the offloaded or the resident QSA K/V",
                "requires SGLANG_QSA_HISPARSE_V3 unset or 'p2-offload'",
                "got SGLANG_QSA_HISPARSE_V3='p2-resident'",
            ],
        ),
        (
            {"SGLANG_QSA_DS_CHANNEL_CONFIG": "c.json", "SGLANG_QSA_CACHE_SHARDING": "2"},
            [
                "SGLANG_QSA_CACHE_SHARDING='2' shards QSA layers",
                "SGLANG_QSA_DS_CHANNEL_CONFIG='c.json' serves models without them",
            ],
        ),
    ],
)
def test_malformed_switch_names_variable_value_and_allowed(
    env: dict[str, str], fragments: list[str]
) -> None:
    """Each malformed or contradictory value raises SwitchError naming variable and allowed set."""
    _assert_refused(env, fragments)


@given(st.text(max_size=12))
@example("0\x1f")  # str.strip() removes the unit separator; int() alone would not
def test_prefix_cache_mb_accepts_only_decimal_digits(raw: str) -> None:
    """Any MB text parses iff, stripped, it is ASCII digits up to the maximum (or it is empty)."""
    env = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": raw}
    text = raw.strip()
    digits = text.isascii() and text.isdigit()
    if raw == "" or (digits and int(text) <= MAX_PREFIX_CACHE_MB):
        assert parse_switches(env).prefix_cache_mb == (int(text) if raw else 0)
    else:
        with pytest.raises(SwitchError):
            parse_switches(env)


def test_switch_error_escapes_exception_handlers() -> None:
    """SwitchError is a BaseException, so SGLang's `except Exception` cannot swallow it."""
    assert issubclass(SwitchError, BaseException)
    assert not issubclass(SwitchError, Exception)


@pytest.mark.parametrize(
    "name", ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB", "SGLANG_QSA_HISPARSE_HOT_BLOCKS"]
)
def test_an_integer_switch_of_thousands_of_digits_is_refused_by_name(name: str) -> None:
    """CPython's int() refuses more than 4,300 digits with a ValueError, which SGLang's
    load_plugins() would log and serve on without the plugin: the parser counts first."""
    with pytest.raises(SwitchError, match=rf"{name}='9999.*\(5000 characters\)' is not allowed"):
        parse_switches({**ON, name: "9" * 5000})
    assert (
        parse_switches(
            {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "0" * 5000 + "7"}
        ).prefix_cache_mb
        == 7
    )


def test_any_error_while_activating_stops_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected Exception inside activation leaves as an ActivationError (a BaseException
    that SGLang's load_plugins() does not swallow), naming the original."""
    from qsa_sglang_plugin import _activation
    from qsa_sglang_plugin._errors import ActivationError

    def broken(*args: object, **kwargs: object) -> None:
        msg = "a defect on the way"
        raise KeyError(msg)

    monkeypatch.setattr(_activation, "verify_fingerprints", broken)
    for name, value in ON.items():
        monkeypatch.setenv(name, value)
    current_switches.cache_clear()
    try:
        with pytest.raises(
            ActivationError, match="could not activate: KeyError: 'a defect on the way'"
        ):
            activate()
    finally:
        current_switches.cache_clear()


def test_activate_with_malformed_switch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point itself stops on a malformed switch, before importing SGLang."""
    monkeypatch.setenv("SGLANG_QSA_MODEL_COMPAT", "true")
    current_switches.cache_clear()
    try:
        with pytest.raises(SwitchError, match="SGLANG_QSA_MODEL_COMPAT='true'"):
            activate()
    finally:
        current_switches.cache_clear()


@pytest.mark.parametrize(
    ("name", "value", "maximum"),
    [
        ("SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB", str(MAX_PREFIX_CACHE_MB + 1), MAX_PREFIX_CACHE_MB),
        ("SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB", str(64 << 30), MAX_PREFIX_CACHE_MB),  # bytes as MiB
        (
            "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES",
            str(MAX_PREFIX_CACHE_ENTRIES + 1),
            MAX_PREFIX_CACHE_ENTRIES,
        ),
    ],
)
def test_absurd_prefix_cache_sizes_are_refused_at_parse_time(
    name: str, value: str, maximum: int
) -> None:
    """A size no host has (a byte count given as MiB, say) fails here, naming the maximum."""
    env = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "1024", name: value}
    with pytest.raises(SwitchError, match=rf"{name}='{value}' is not allowed.*up to {maximum}"):
        parse_switches(env)
    assert parse_switches({**env, name: str(maximum)}) is not None


DS = "SGLANG_QSA_DS_CHANNEL_CONFIG"


def test_double_sparsity_switches_take_the_library_defaults() -> None:
    from qsa_kernels.double_sparsity import DSConfig

    switches = parse_switches({DS: "/models/channels.json"})
    ds = switches.double_sparsity
    assert ds is not None
    assert switches.features == (Feature.FRAMEWORK, Feature.DOUBLE_SPARSITY)
    defaults = DSConfig()
    assert (ds.heavy_channel_num, ds.heavy_token_num, ds.sparse_decode_threshold) == (
        defaults.heavy_channel_num,
        defaults.heavy_token_num,
        defaults.sparse_decode_threshold,
    )
    assert ds.heavy_channel_type == defaults.heavy_channel_type.value
    tuned = parse_switches(
        {
            DS: "c.json",
            "SGLANG_QSA_DS_HEAVY_CHANNELS": "8",
            "SGLANG_QSA_DS_HEAVY_TOKENS": "64",
            "SGLANG_QSA_DS_CHANNEL_TYPE": "k",
            "SGLANG_QSA_DS_THRESHOLD": "0",
        }
    ).double_sparsity
    assert tuned is not None
    assert (tuned.heavy_channel_num, tuned.heavy_token_num, tuned.heavy_channel_type) == (
        8,
        64,
        "k",
    )
    assert tuned.sparse_decode_threshold == 0


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"SGLANG_QSA_DS_HEAVY_TOKENS": "64"},
            ["SGLANG_QSA_DS_HEAVY_TOKENS set without SGLANG_QSA_DS_CHANNEL_CONFIG"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_DS_CHANNEL_TYPE": "v"},
            ["SGLANG_QSA_DS_CHANNEL_TYPE='v' is not allowed", "'q', 'k', 'qk'"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_DS_HEAVY_CHANNELS": "0"},
            ["SGLANG_QSA_DS_HEAVY_CHANNELS='0' is not allowed", "a positive integer"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_DS_THRESHOLD": "-1"},
            ["SGLANG_QSA_DS_THRESHOLD='-1' is not allowed", "0 (off) or a positive"],
        ),
    ],
)
def test_a_malformed_double_sparsity_switch_is_named(
    env: dict[str, str], fragments: list[str]
) -> None:
    _assert_refused(env, fragments)


def test_ds_offload_turns_on_the_offload_feature_and_allows_verification() -> None:
    switches = parse_switches(
        {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "1", "SGLANG_QSA_HISPARSE_VERIFY": "1"}
    )
    assert switches.double_sparsity is not None
    assert switches.double_sparsity.offload
    assert switches.offload
    assert switches.verify_offload
    assert switches.features == (
        Feature.FRAMEWORK,
        Feature.LIFECYCLE,
        Feature.DOUBLE_SPARSITY,
        Feature.KV_POOL,
    )
    resident = parse_switches({DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "0"})
    assert resident.double_sparsity is not None
    assert not resident.double_sparsity.offload
    assert not resident.offload


def test_ds_offload_stages_by_a_window_of_layers_unless_told_whole() -> None:
    """``SGLANG_QSA_DS_OFFLOAD_STAGING``: ``window`` by default, ``whole`` on request."""
    for value, window in (("", True), ("window", True), ("whole", False)):
        env = {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "1", "SGLANG_QSA_DS_OFFLOAD_STAGING": value}
        ds = parse_switches(env).double_sparsity
        assert ds is not None
        assert ds.staging_window is window


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "yes"},
            ["SGLANG_QSA_DS_OFFLOAD='yes' is not allowed", "unset, '0', '1'"],
        ),
        (
            {"SGLANG_QSA_DS_OFFLOAD": "1"},
            ["SGLANG_QSA_DS_OFFLOAD set without SGLANG_QSA_DS_CHANNEL_CONFIG"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_HISPARSE_VERIFY": "1"},
            ["SGLANG_QSA_HISPARSE_VERIFY='1' checks the offload", "SGLANG_QSA_DS_OFFLOAD='1'"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "1", "SGLANG_QSA_DS_OFFLOAD_STAGING": "half"},
            ["SGLANG_QSA_DS_OFFLOAD_STAGING='half' is not allowed", "'window', 'whole'"],
        ),
        (
            {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD_STAGING": "whole"},
            ["SGLANG_QSA_DS_OFFLOAD_STAGING set without SGLANG_QSA_DS_OFFLOAD='1'"],
        ),
    ],
)
def test_a_malformed_ds_offload_switch_is_named(env: dict[str, str], fragments: list[str]) -> None:
    _assert_refused(env, fragments)


def test_double_sparsity_and_the_qsa_switches_are_refused_together() -> None:
    with pytest.raises(SwitchError) as caught:
        parse_switches({**ON, DS: "c.json"})
    text = str(caught.value)
    assert "SGLANG_QSA_DS_CHANNEL_CONFIG='c.json' serves models without QSA layers" in text
    assert "SGLANG_QSA_HISPARSE_V3='p2-offload'" in text


@pytest.mark.parametrize(
    "env",
    [
        {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"},
        {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-resident"},
        {DS: "c.json", "SGLANG_QSA_DS_OFFLOAD": "1"},
    ],
)
def test_every_mode_that_needs_the_tree_cache_registers_it(env: dict[str, str]) -> None:
    """Start-up requires --radix-cache-backend qsa_hisparse with each of these: it is there."""
    from qsa_sglang_plugin._hooks import registrations_for

    entries = registrations_for(parse_switches(env).features)
    assert ("radix_cache_backend", "qsa_hisparse") in {
        (r.registry.name.lower(), r.name) for r in entries
    }


def test_hot_blocks_default_to_none_and_parse_with_offload() -> None:
    """Unset leaves the library's default; a value is taken as given (start-up checks its range)."""
    env = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    assert parse_switches(env).hot_blocks is None
    assert parse_switches({**env, "SGLANG_QSA_HISPARSE_HOT_BLOCKS": " 1024 "}).hot_blocks == 1024


def test_cache_sharding_with_offload_is_its_own_feature() -> None:
    """N > 1 with p2-offload turns on cache_sharding; 1 (or unset) is off."""
    env = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
    assert parse_switches(env).cache_sharding == 1
    assert Feature.CACHE_SHARDING not in parse_switches(env).features
    assert (
        Feature.CACHE_SHARDING
        not in parse_switches({**env, "SGLANG_QSA_CACHE_SHARDING": "1"}).features
    )
    sharded = parse_switches({**env, "SGLANG_QSA_CACHE_SHARDING": "4"})
    assert sharded.cache_sharding == 4
    assert Feature.CACHE_SHARDING in sharded.features
    assert not sharded.resident_sharding


def test_cache_sharding_without_an_offload_keeps_the_k_v_resident_in_sharded_stores() -> None:
    """N > 1 alone is resident sharding: the plugin's QSA backend and the one-page K/V pool, no
    request lifecycle, no offload."""
    switches = parse_switches({"SGLANG_QSA_CACHE_SHARDING": "2"})
    assert switches.any_on
    assert switches.resident_sharding
    assert switches.plugin_holds_raw_kv
    assert not switches.offload
    assert switches.features == (
        Feature.FRAMEWORK,
        Feature.CACHE_SHARDING,
        Feature.QSA_BACKEND,
        Feature.KV_POOL,
    )


def test_index_sharding_rides_on_resident_cache_sharding() -> None:
    """``SGLANG_QSA_INDEX_SHARDING=1`` with ``SGLANG_QSA_CACHE_SHARDING=N`` adds its own feature
    to resident sharding's; ``0`` or unset leaves it off."""
    switches = parse_switches({"SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"})
    assert switches.index_sharding
    assert switches.features == (
        Feature.FRAMEWORK,
        Feature.CACHE_SHARDING,
        Feature.INDEX_SHARDING,
        Feature.QSA_BACKEND,
        Feature.KV_POOL,
    )
    off = parse_switches({"SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "0"})
    assert not off.index_sharding
    assert Feature.INDEX_SHARDING not in off.features


def test_index_sharding_rides_on_the_offloads_cache_sharding_too() -> None:
    """D2 with ``p2-offload`` and ``SGLANG_QSA_CACHE_SHARDING=N``: the index is sharded over the
    host arenas' groups; the offload's features stay, and the index's hooks join them."""
    env = {**ON, "SGLANG_QSA_CACHE_SHARDING": "2", "SGLANG_QSA_INDEX_SHARDING": "1"}
    switches = parse_switches(env)
    assert switches.index_sharding
    assert not switches.resident_sharding
    assert switches.features == (
        Feature.FRAMEWORK,
        Feature.MODEL_COMPAT,
        Feature.HISPARSE,
        Feature.LIFECYCLE,
        Feature.CACHE_SHARDING,
        Feature.INDEX_SHARDING,
        Feature.QSA_BACKEND,
        Feature.KV_POOL,
    )


def test_index_sharding_composes_with_the_offloads_host_prefix_cache() -> None:
    """D1 + D2 with ``p2-offload`` and the host prefix cache: accepted (a checkpoint reads the
    whole index through the rank's shard, a restore writes back the rank's pages)."""
    env = {
        **ON,
        "SGLANG_QSA_CACHE_SHARDING": "2",
        "SGLANG_QSA_INDEX_SHARDING": "1",
        "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64",
    }
    switches = parse_switches(env)
    assert switches.index_sharding
    assert switches.prefix_cache_mb == 64
    assert {Feature.PREFIX_CACHE, Feature.INDEX_SHARDING} <= set(switches.features)


@pytest.mark.parametrize("cache_sharding", [None, "1"])
def test_index_sharding_alone_shards_the_index_beside_upstreams_resident_backend(
    cache_sharding: str | None,
) -> None:
    """D2 without D1: the index's hooks alone (no plugin QSA backend, SGLang's K/V pool)."""
    env = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_INDEX_SHARDING": "1"}
    if cache_sharding is not None:
        env["SGLANG_QSA_CACHE_SHARDING"] = cache_sharding
    switches = parse_switches(env)
    assert switches.index_sharding
    assert (switches.cache_sharding, switches.resident_sharding) == (1, False)
    assert not switches.plugin_holds_raw_kv
    assert switches.features == (Feature.FRAMEWORK, Feature.MODEL_COMPAT, Feature.INDEX_SHARDING)
    alone = parse_switches({"SGLANG_QSA_INDEX_SHARDING": "1"})
    assert alone.features == (Feature.FRAMEWORK, Feature.INDEX_SHARDING)


def test_a_shared_tier_store_parses_with_the_prefix_cache(tmp_path: Path) -> None:
    """SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE names the master (segment_mb defaults to 1024) or
    a directory, made at parse time so an unusable one is refused before the engine starts."""
    from qsa_hostcache import DiskAddress, MooncakeAddress

    with_cache = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"}
    plain = parse_switches(
        {**with_cache, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": "mooncake://h:7"}
    )
    sized = parse_switches(
        {**with_cache, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": "mooncake://h:7?segment_mb=0"}
    )
    assert plain.prefix_cache_store == MooncakeAddress("h", 7, 1024)
    assert sized.prefix_cache_store == MooncakeAddress("h", 7, 0)
    assert parse_switches(with_cache).prefix_cache_store is None
    directory = tmp_path / "tier"
    disk = parse_switches(
        {**with_cache, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": f"file://{directory}"}
    )
    assert disk.prefix_cache_store == DiskAddress(directory)
    assert directory.is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SwitchError, match=r"a-file/tier.*is not usable"):
        parse_switches(
            {**with_cache, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": f"file://{blocker}/tier"}
        )


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"SGLANG_QSA_INDEX_SHARDING": "yes", "SGLANG_QSA_CACHE_SHARDING": "2"},
            ["SGLANG_QSA_INDEX_SHARDING='yes'", "allowed: unset, '0', '1'"],
        ),
        (
            {
                "SGLANG_QSA_MODEL_COMPAT": "1",
                "SGLANG_QSA_HISPARSE_V3": "p2-resident",
                "SGLANG_QSA_INDEX_SHARDING": "1",
                "SGLANG_QSA_CACHE_SHARDING": "1",
            },
            [
                "SGLANG_QSA_INDEX_SHARDING='1' without cache sharding",
                "SGLANG_QSA_CACHE_SHARDING='1'",
                "SGLANG_QSA_HISPARSE_V3='p2-resident'",
                "allowed: SGLANG_QSA_HISPARSE_V3 unset or 'p2-offload', or "
                "SGLANG_QSA_CACHE_SHARDING of 2 or more",
            ],
        ),
        (
            {"SGLANG_QSA_INDEX_SHARDING": "1", "SGLANG_QSA_DS_CHANNEL_CONFIG": "channels.json"},
            ["SGLANG_QSA_INDEX_SHARDING='1'", "SGLANG_QSA_DS_CHANNEL_CONFIG", "unset one side"],
        ),
    ],
)
def test_index_sharding_refuses_a_bad_combination_by_name(
    env: dict[str, str], fragments: list[str]
) -> None:
    _assert_refused(env, fragments)


@pytest.mark.parametrize("mode", [{}, ON], ids=["resident", "p2-offload"])
def test_index_sharding_alone_serves_beside_upstreams_backend_or_the_offload(
    mode: dict[str, str],
) -> None:
    """Without cache sharding the index is sharded over every TP rank (D2 alone), resident
    (no mode) or beside the offload, whose GPU pool then holds only the rank's index pages."""
    env = {**mode, "SGLANG_QSA_INDEX_SHARDING": "1"}
    switches = parse_switches(env)
    assert switches.index_sharding_alone
    assert switches.cache_sharding == 1
    assert not parse_switches({**env, "SGLANG_QSA_INDEX_SHARDING": "0"}).index_sharding_alone


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64", "STORE": "redis://h:7"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE='redis://h:7'", "mooncake://HOST:PORT"],
        ),
        (
            {"SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64", "STORE": "mooncake://h"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE='mooncake://h'", "mooncake://HOST:PORT"],
        ),
        (
            {"STORE": "mooncake://h:7"},
            ["requires SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB > 0"],
        ),
    ],
)
def test_a_bad_shared_tier_store_is_refused_naming_the_value_and_the_form(
    env: dict[str, str], fragments: list[str]
) -> None:
    environ = {**ON, **env}
    environ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE"] = environ.pop("STORE")
    _assert_refused(environ, fragments)


def test_the_prefix_cache_admission_parses_with_the_prefix_cache() -> None:
    from qsa_hostcache import Admission

    with_cache = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"}
    admit = "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT"
    assert parse_switches(with_cache).prefix_cache_admission is None
    assert parse_switches({**with_cache, admit: "second"}).prefix_cache_admission is (
        Admission.SECOND
    )
    assert parse_switches({**with_cache, admit: "always"}).prefix_cache_admission is (
        Admission.ALWAYS
    )


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64", "ADMIT": "twice"},
            [
                "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT='twice'",
                "allowed: unset, 'always', 'second'",
            ],
        ),
        (
            {"ADMIT": "second"},
            ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT='second'", "PREFIX_CACHE_MB > 0"],
        ),
    ],
)
def test_a_bad_admission_is_refused_naming_the_value_and_the_allowed_ones(
    env: dict[str, str], fragments: list[str]
) -> None:
    environ = {**ON, **env}
    environ["SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT"] = environ.pop("ADMIT")
    _assert_refused(environ, fragments)


def test_a_refused_disk_tier_makes_no_directory(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    store = {**ON, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": f"file://{directory}"}
    with_cache = {**store, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "64"}
    for environ in (store, {**with_cache, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT": "twice"}):
        with pytest.raises(SwitchError):
            parse_switches(environ)
        assert not directory.exists()
