"""`explain(error)`: map failures users hit on Ascend (messages as torch_npu, CANN, HCCL and DeepSpeed print
them) to their cause and the fix."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Union

SET_ENV_HINT = (
    "source the CANN environment before Python starts: `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
    "(newer CANN: `source /usr/local/Ascend/cann/set_env.sh` and `source /usr/local/Ascend/nnal/atb/set_env.sh`). "
    "In Jupyter, register the kernel with `kit.envs` (notebook 01), which stores these variables in kernel.json, "
    "then restart the kernel."
)


@dataclass(frozen=True)
class Explanation:
    """What went wrong and what to do."""

    key: str
    cause: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.key}] cause: {self.cause}\nfix: {self.fix}"


@dataclass(frozen=True)
class _Rule:
    key: str
    pattern: str
    cause: str
    fix: str


# Ordered: the first matching rule wins, so specific messages come before generic ones.
RULES = [
    _Rule(
        "transfer_to_npu_missing",
        r"has no attribute '_cuda_setDevice'|has no attribute '_cuda_",
        "CUDA-written code called torch.cuda on a machine whose accelerator is an Ascend NPU; without the "
        "transfer_to_npu patch torch.cuda is the stock CUDA module, which this torch build lacks.",
        "put `import torch_npu` and `from torch_npu.contrib import transfer_to_npu` (or "
        "`kit.system.device.enable_transfer_to_npu()`) at the top of the entry script, before other imports; better, use "
        "device 'npu' via `kit.system.device.get_device()`.",
    ),
    _Rule(
        "two_accelerators",
        r"Two accelerators cannot be used at the same time",
        "a CUDA build of torch is installed next to torch_npu; torch_npu needs the CPU build of the same version.",
        "reinstall the CPU build of torch matching torch_npu (x86: `pip install torch==X.Y.Z+cpu --index-url "
        "https://download.pytorch.org/whl/cpu`; aarch64: `pip install torch==X.Y.Z`), see envs/README.md.",
    ),
    _Rule(
        "torch_npu_version_mismatch",
        r"torch_npu[^\n]*undefined symbol|libtorch_npu\.so: undefined symbol",
        "torch_npu was built for a different torch version than the one installed (its C++ symbols do not resolve).",
        "install the torch_npu release made for your torch (torch_npu X.Y.Z[.postN] pairs with torch X.Y.Z; "
        "table in envs/README.md), e.g. `pip install torch==2.1.0 torch_npu==2.1.0.post12`; run notebook 00 to check.",
    ),
    _Rule(
        "cann_env_missing",
        r"lib(hccl|ascendcl|acl_op_compiler|ge_runner|graph|runtime|opapi|nnopbase)\.so[^\n]*"
        r"(cannot open shared object|No such file)",
        "this process (often a Jupyter kernel) was started without the CANN environment, so the dynamic loader "
        "cannot find the CANN libraries that torch_npu links against.",
        SET_ENV_HINT,
    ),
    _Rule(
        "deepspeed_ascend_home",
        r"KeyError: ['\"]ASCEND_HOME_PATH['\"]",
        "DeepSpeed's NPU op builder reads ASCEND_HOME_PATH, which only CANN's set_env.sh exports "
        "(deepspeed/ops/op_builder/npu/builder.py installed_cann_path).",
        SET_ENV_HINT,
    ),
    # Submitting a ModelArts training job: the ModelArts user manual, section "提交训练作业常见问题"
    _Rule(
        "obs_bucket_quota",
        r"create more buckets than allowed|TooManyBuckets",
        "the account already has as many OBS buckets as its quota allows, so no new bucket could be created.",
        "delete a bucket you no longer need, or use an existing one: point OBS_DIR (and DATA_OBS / MODEL_OBS) of "
        "`python -m kit job` at obs://<existing-bucket>/<folder>/.",
    ),
    _Rule(
        "swr_namespace_quota",
        r"number of namespaces exceeds the upper limit|namespace is invalid",
        "SWR allows few organizations per account (5 by default) and the limit is reached, or the image names "
        "an organization that does not exist.",
        "delete an SWR organization you no longer need, or use an existing one: IMAGE_URL = "
        "<existing-organization>/<image>:<tag>.",
    ),
    _Rule(
        "exec_format_error",
        r"exec format error|exet format error",
        "the job's container could not start its command: the image was built for another CPU architecture "
        "than the flavor's nodes (an x86_64 image on Arm/aarch64 Ascend nodes, or the reverse); the manual names "
        "a wrong resource flavor as the cause.",
        "pick the flavor the image was built for (ModelArts lists them: ShowTrainingJobFlavors), or build the "
        "image for the nodes' architecture (`docker buildx build --platform linux/arm64` for Ascend).",
    ),
    _Rule(
        "huaweicloud_unauthorized",
        r"HTTP 401|\b401\b[^\n]*Unauthorized|SVCSTG\.SWR\.4010000|Authenticate Error|APIGW\.0301",
        "Huawei Cloud refused the request's credentials: the access key / secret key are missing, wrong or "
        "expired (a temporary key without its security token), or belong to another account or project.",
        "export HUAWEICLOUD_SDK_AK and HUAWEICLOUD_SDK_SK of an IAM user allowed to use ModelArts (and "
        "HUAWEICLOUD_SDK_PROJECT_ID of the job's region; HUAWEICLOUD_SDK_SECURITY_TOKEN with a temporary key) in "
        "the environment, never in a notebook or a file, then submit again.",
    ),
    _Rule(
        "hccl_notify_timeout",
        r"\bEI0002\b",
        "HCCL timed out waiting for another rank inside a collective: a rank crashed, hung, is much slower "
        "(e.g. still loading data or compiling), or ranks issued collectives in a different order.",
        "look for the first error on the other ranks' logs (the root cause is usually there); if all ranks are "
        "healthy but slow to start, raise `HCCL_EXEC_TIMEOUT` (and `HCCL_CONNECT_TIMEOUT`, default 120 s); make "
        "every rank run the same collectives in the same order.",
    ),
    _Rule(
        "hccl_socket_timeout",
        r"\bEI0006\b",
        "HCCL could not build its socket links in time: some rank started late or not at all, or the nodes cannot "
        "reach each other (wrong MASTER_ADDR, NIC, firewall, ranks on different network segments).",
        "start every node within the timeout (raise `HCCL_CONNECT_TIMEOUT`, e.g. 1200), check MASTER_ADDR / "
        "NNODES / NODE_RANK on each node, set `HCCL_SOCKET_IFNAME` / `GLOO_SOCKET_IFNAME` to the right NIC.",
    ),
    _Rule(
        "leftover_process",
        r"\bEJ0001\b",
        "the NPU is still held by a previous training process (HCCP could not initialise).",
        "find it with `npu-smi info` (Process id column) or `ps -ef | grep python`, stop it "
        "(`kill <pid>`; in a notebook, restart the kernel that ran training), wait ~10 s, then start again.",
    ),
    _Rule(
        "task_queue_interactive",
        r"TASK_QUEUE_ENABLE is set to 0",
        "torch_npu disables its task queue inside IPython/Jupyter, which makes NPU training slower.",
        "run long training as a subprocess (`kit.train` launch from notebook 04), not in the kernel.",
    ),
    _Rule(
        "invalid_device",
        r"Invalid device ID|SetDevice failed|set device.*failed",
        "the process asked for a card it cannot see: more processes than visible NPUs, or the wrong "
        "visible-devices variable.",
        "use ASCEND_RT_VISIBLE_DEVICES (not CUDA_VISIBLE_DEVICES) to choose NPUs, numbered from 0 inside the "
        "container, and launch at most as many processes per node as visible NPUs.",
    ),
]

_CUDA_VISIBLE_ON_NPU = Explanation(
    "cuda_visible_devices_on_npu",
    "CUDA_VISIBLE_DEVICES is set but this is an NPU machine: torch_npu ignores it, so every process sees all NPUs "
    "(and they may all land on card 0).",
    "set ASCEND_RT_VISIBLE_DEVICES instead (e.g. `export ASCEND_RT_VISIBLE_DEVICES=0,1`) and unset "
    "CUDA_VISIBLE_DEVICES; `kit.system.device.visible_devices_env()` names the right variable.",
)


def explain(
    error: Union[BaseException, str], env: Optional[Mapping[str, str]] = None, on_npu: Optional[bool] = None
) -> Optional[Explanation]:
    """Cause and fix for a known failure (an exception or its text); None if it is not a known one.

    `env` (default os.environ) and `on_npu` let it also spot CUDA_VISIBLE_DEVICES used on an NPU machine.
    """
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    for rule in RULES:
        if re.search(rule.pattern, text):
            if rule.key == "invalid_device" and _cuda_visible_on_npu(env, on_npu):
                return _CUDA_VISIBLE_ON_NPU
            return Explanation(rule.key, rule.cause, rule.fix)
    if _cuda_visible_on_npu(env, on_npu):
        return _CUDA_VISIBLE_ON_NPU
    return None


def _cuda_visible_on_npu(env: Optional[Mapping[str, str]], on_npu: Optional[bool]) -> bool:
    env = os.environ if env is None else env
    if on_npu is None:
        from kit.system.device import torch_npu_import

        on_npu = torch_npu_import()[0] is not None
    return bool(
        on_npu and env.get("CUDA_VISIBLE_DEVICES") is not None and not env.get("ASCEND_RT_VISIBLE_DEVICES")
    )
