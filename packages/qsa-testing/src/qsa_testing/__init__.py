"""qsa-testing: test support for the QSA HiSparse workspace; never installed for serving.

Tiny dummy models written at test time (:func:`tiny_qwen4_exp`, :func:`tiny_llama`; for
benchmarks :func:`full_depth_qwen4_exp` and :func:`llama_8b_shaped`; :func:`marlin_qwen4_exp`
for the W4A16 checkpoints of :func:`write_autoround_checkpoints`), named
stand-ins for what a machine cannot run as is (:mod:`qsa_testing.standins`), scenarios on several
gloo ranks of one machine (:func:`run_on_gloo_ranks`), QSA-shaped selections
(:func:`random_block_selection`) and SGLang batches (:func:`extend_batch`, :func:`decode_batch`),
and real SGLang
0.5.23 servers for tests (:func:`start_engine`, :class:`EnginePool`, and the ``engines`` fixture
of :mod:`qsa_testing.pytest_plugin`; a command's flags as their server arguments,
:func:`server_args_of_flags`; the maintainer's production command, :data:`PRODUCTION_FLAGS`), with
comparisons that watch logprobs, not only tokens, and SGLang's own serving client against them
(:func:`run_serving_client`).
"""

from qsa_testing._autoround import (
    AutoRoundCheckpoints,
    autoround_quantization_config,
    write_autoround_checkpoints,
)
from qsa_testing._checkpoints import PleTableShape, ple_table_shape, write_ple_checkpoint
from qsa_testing._compare import (
    BF16_LOGIT_STEP,
    assert_same_generation,
    assert_served_from_storage,
    logprob_gap,
    routing_differences,
)
from qsa_testing._engine import (
    Engine,
    EngineConfig,
    GenerateRequest,
    Generation,
    Platform,
    cuda_graphs_requested,
    current_platform,
    platform_standins,
    running_engine,
    start_engine,
)
from qsa_testing._errors import (
    EngineConfigError,
    EngineRequestError,
    EngineStartError,
    ModelSpecError,
    StandInError,
)
from qsa_testing._flags import server_args_of_flags
from qsa_testing._gloo import Scenario, run_on_gloo_ranks, zigzag_prefill_cp
from qsa_testing._models import (
    TinyModel,
    TinyModelKind,
    full_depth_qwen4_exp,
    llama_8b_shaped,
    marlin_qwen4_exp,
    tiny_llama,
    tiny_qwen4_exp,
)
from qsa_testing._pool import EnginePool, EngineStart
from qsa_testing._production import PRODUCTION_FLAGS, PRODUCTION_PLUGIN_FLAGS, PRODUCTION_SWITCHES
from qsa_testing._selection import (
    IndexPoolShape,
    decode_batch,
    extend_batch,
    random_block_selection,
)
from qsa_testing._selection_trace import SelectionDifference, SelectionTrace
from qsa_testing._serving_client import (
    ClientReport,
    random_ids_flags,
    run_serving_client,
    shared_prefix_flags,
    word_level_tokenizer,
)
from qsa_testing._sglang_load import LoadMode, SGLangLoad, load_into_sglang_qwen4_exp
from qsa_testing._version import __version__
from qsa_testing._vision import tiny_image

__all__ = (  # noqa: RUF022 (grouped by topic, as the comments say)
    "__version__",
    # tiny models
    "TinyModel",
    "TinyModelKind",
    "tiny_llama",
    "tiny_qwen4_exp",
    "full_depth_qwen4_exp",
    "llama_8b_shaped",
    "marlin_qwen4_exp",
    "tiny_image",
    # real PLE weights for a tiny model
    "PleTableShape",
    "ple_table_shape",
    "write_ple_checkpoint",
    # a whole tiny Qwen4Exp as an AutoRound W4A16 export and dequantized to bf16
    "AutoRoundCheckpoints",
    "autoround_quantization_config",
    "write_autoround_checkpoints",
    # a checkpoint loaded by SGLang's own Qwen4Exp on the CPU (a fresh process)
    "LoadMode",
    "SGLangLoad",
    "load_into_sglang_qwen4_exp",
    # engines
    "Engine",
    "EngineConfig",
    "EnginePool",
    "EngineStart",
    "GenerateRequest",
    "Generation",
    "Platform",
    "cuda_graphs_requested",
    "current_platform",
    "platform_standins",
    "running_engine",
    "start_engine",
    "server_args_of_flags",
    # the maintainer's production command
    "PRODUCTION_FLAGS",
    "PRODUCTION_PLUGIN_FLAGS",
    "PRODUCTION_SWITCHES",
    # SGLang's own serving client
    "ClientReport",
    "random_ids_flags",
    "run_serving_client",
    "shared_prefix_flags",
    "word_level_tokenizer",
    # comparisons
    "BF16_LOGIT_STEP",
    "assert_same_generation",
    "assert_served_from_storage",
    "logprob_gap",
    "routing_differences",
    # distributed scenarios on one machine
    "Scenario",
    "run_on_gloo_ranks",
    "zigzag_prefill_cp",
    # QSA-shaped inputs and SGLang batches
    "random_block_selection",
    "SelectionDifference",
    "SelectionTrace",
    "extend_batch",
    "IndexPoolShape",
    "decode_batch",
    # errors
    "EngineConfigError",
    "EngineRequestError",
    "EngineStartError",
    "ModelSpecError",
    "StandInError",
)
