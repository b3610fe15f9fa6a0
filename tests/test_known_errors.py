"""explain() on the messages users really see (as printed by torch, torch_npu, CANN/HCCL and DeepSpeed)."""

from __future__ import annotations

import pytest

from kit.core.known_errors import explain

REAL_MESSAGES = {
    "transfer_to_npu_missing": "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'",
    "cann_env_missing": "OSError: libhccl.so: cannot open shared object file: No such file or directory",
    "cann_env_missing ": "ImportError: libascendcl.so: cannot open shared object file: No such file or directory",
    "deepspeed_ascend_home": (
        'Traceback (most recent call last):\n  File ".../deepspeed/ops/op_builder/npu/builder.py", line 55, in '
        'installed_cann_path\n    if "ASCEND_HOME_PATH" in os.environ or os.path.exists(os.environ["ASCEND_HOME_PATH"]):'
        "\nKeyError: 'ASCEND_HOME_PATH'"
    ),
    "torch_npu_version_mismatch": (
        "ImportError: /usr/local/python3.9.2/lib/python3.9/site-packages/torch_npu/lib/libtorch_npu.so: undefined "
        "symbol: _ZNK3c1010TensorImpl36is_contiguous_nondefault_policy_implENS_12MemoryFormatE"
    ),
    "two_accelerators": (
        "RuntimeError: Two accelerators cannot be used at the same time in PyTorch: npu and cuda. "
        "You can install the cpu version of PyTorch to use your npu device"
    ),
    "hccl_notify_timeout": (
        "RuntimeError: ACL stream synchronize failed, error code:507048\nEI0002: [PID: 2873] 2024-05-11-10:12:06.715.398 "
        "The wait execution of the Notify register times out. Reason: The Notify register has not received the Notify "
        "record from remote rank [3]."
    ),
    "hccl_socket_timeout": (
        "EI0006: [PID: 1024] 2024-05-11-10:12:06 Getting socket times out. Reason: 1. The remote does not initiate a "
        "connect request. some NPUs in the cluster are abnormal."
    ),
    "leftover_process": (
        "EJ0001: [PID: 1103] 2024-01-01-00:00:00 Failed to initialize the HCCP process. Reason: Maybe "
        "the last training process is running. Solution: Wait for 10s after killing the last training "
        "process and try again."
    ),
}


@pytest.mark.parametrize("expected,message", list(REAL_MESSAGES.items()))
def test_known_messages_get_cause_and_fix(expected, message):
    why = explain(message, env={}, on_npu=False)
    assert why is not None and why.key == expected.strip()
    assert why.cause and why.fix


def test_fixes_name_the_concrete_next_step():
    assert "transfer_to_npu" in explain(REAL_MESSAGES["transfer_to_npu_missing"], env={}, on_npu=False).fix
    assert "set_env.sh" in explain(REAL_MESSAGES["cann_env_missing"], env={}, on_npu=False).fix
    assert "set_env.sh" in explain(REAL_MESSAGES["deepspeed_ascend_home"], env={}, on_npu=False).fix
    assert "HCCL_CONNECT_TIMEOUT" in explain(REAL_MESSAGES["hccl_socket_timeout"], env={}, on_npu=False).fix
    assert "npu-smi" in explain(REAL_MESSAGES["leftover_process"], env={}, on_npu=False).fix


def test_exception_objects_are_accepted():
    why = explain(KeyError("ASCEND_HOME_PATH"), env={}, on_npu=False)
    assert why is not None and why.key == "deepspeed_ascend_home"


def test_cuda_visible_devices_on_npu():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    why = explain("RuntimeError: SetDevice failed, Invalid device ID", env=env, on_npu=True)
    assert why.key == "cuda_visible_devices_on_npu" and "ASCEND_RT_VISIBLE_DEVICES" in why.fix
    # the same message on a machine that sets the right variable is the generic invalid-device case
    assert (
        explain("Invalid device ID", env={"ASCEND_RT_VISIBLE_DEVICES": "0"}, on_npu=True).key
        == "invalid_device"
    )
    # and on a GPU machine CUDA_VISIBLE_DEVICES is right: nothing to explain
    assert explain("some other error", env=env, on_npu=False) is None


def test_unknown_message_returns_none():
    assert explain("ValueError: something unrelated", env={}, on_npu=False) is None
