"""qsa-sglang-plugin: the SGLang 0.5.23 plugin of QSA HiSparse.

The ``sglang.srt.plugins`` entry point ``qsa_hisparse`` (:func:`activate`) turns the QSA HiSparse
features on inside an unmodified SGLang from ``SGLANG_QSA_*`` switches, and fails closed: every
activation failure raises :class:`ActivationError`, a ``BaseException`` that SGLang's plugin
loader cannot swallow. :mod:`qsa_sglang_plugin.launch` starts a server and reports ready only after
each TP rank has written a verified activation record; :mod:`qsa_sglang_plugin.doctor` checks a
machine before serving.
"""

from qsa_sglang_plugin._activation import ActivationRecord, activate
from qsa_sglang_plugin._adapters import (
    DIGEST_SERVER_FIELDS,
    cache_namespace_from_sglang,
    capacity_plan_from_sglang,
    config_digest_from_sglang,
    mm_items_from_sglang,
    prompt_identity_from_sglang,
)
from qsa_sglang_plugin._errors import (
    ActivationError,
    AdapterError,
    ConfigurationError,
    FingerprintMismatchError,
    ForeignHookError,
    HookNotAppliedError,
    LaunchError,
    SwitchError,
)
from qsa_sglang_plugin._switches import (
    ENV_ACTIVATION_DIR,
    ENV_SGLANG_PLUGINS,
    PLUGIN_NAME,
    SWITCH_PREFIX,
    Feature,
    HiSparseMode,
    Switches,
    parse_switches,
)
from qsa_sglang_plugin._version import __version__

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    "__version__",
    # entry point and activation records
    "activate",
    "ActivationRecord",
    # switches, and the names an engine's environment uses
    "PLUGIN_NAME",
    "SWITCH_PREFIX",
    "ENV_ACTIVATION_DIR",
    "ENV_SGLANG_PLUGINS",
    "Feature",
    "HiSparseMode",
    "Switches",
    "parse_switches",
    # adapters from SGLang objects to the libraries
    "DIGEST_SERVER_FIELDS",
    "cache_namespace_from_sglang",
    "capacity_plan_from_sglang",
    "config_digest_from_sglang",
    "mm_items_from_sglang",
    "prompt_identity_from_sglang",
    # errors
    "ActivationError",
    "AdapterError",
    "ConfigurationError",
    "FingerprintMismatchError",
    "ForeignHookError",
    "HookNotAppliedError",
    "LaunchError",
    "SwitchError",
)
