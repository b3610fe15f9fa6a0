"""Third-party chatter goes to the log, real warnings still reach stderr (kit.system.noise)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

from kit.system.noise import quiet, real_lines


def test_known_noise_goes_to_the_log_and_real_lines_come_back(tmp_path, capfd):
    log = tmp_path / "logs" / "third_party.log"
    with quiet(log, loggers=("some.library",)):
        # a compiler probe, the way DeepSpeed's CPU op check runs one: a child writing to the inherited fd 2
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.stderr.write('/usr/bin/ld: cannot find -laio: No such file\\n')",
            ],
            check=True,
        )
        warnings.warn_explicit("`x` is deprecated", FutureWarning, "lib.py", 3)
        sys.stderr.write("\r  0%|          | 0/12 [00:00<?, ?it/s]\r100%|##########| 12/12 [00:00<00:00]\n")
        sys.stderr.write("the disk is almost full\n")
        logging.getLogger("some.library").warning("not shown")
        assert logging.getLogger("some.library").level == logging.ERROR
    err = capfd.readouterr().err
    assert err == "the disk is almost full\n"
    text = log.read_text()
    assert "cannot find -laio" in text and "FutureWarning" in text and "12/12" in text
    assert "the disk is almost full" in text
    assert logging.getLogger("some.library").level == logging.NOTSET


def test_a_block_that_prints_nothing_writes_no_log(tmp_path, capfd):
    with quiet(tmp_path / "x.log"):
        pass
    assert not (tmp_path / "x.log").exists() and capfd.readouterr().err == ""


def test_real_lines_split_tqdm_frames_and_keep_what_is_not_noise():
    text = "USDT:2026 profiler_start\n  warnings.warn(\nerror: out of memory\r 50%|#####     | 1/2\n"
    assert real_lines(text) == ["error: out of memory"]
    # lm-eval's git probe outside a checkout (notebook 07's lm-eval cell showed it as a red box)
    git = "fatal: not a git repository (or any of the parent directories): .git\nfatal: bad object HEAD\n"
    assert real_lines(git) == ["fatal: bad object HEAD"]
    # torch's extension builder, when DeepSpeed's CPU op does build (the py310-torch25 stack)
    build = (
        "No CUDA runtime is found, using CUDA_HOME='/usr/local'\n"
        "Using /root/.cache/torch_extensions/py310_cu124 as PyTorch extensions root...\n"
        "Emitting ninja build file /root/.cache/torch_extensions/x/build.ninja...\n"
        "Building extension module deepspeed_shm_comm...\n"
        "Allowing ninja to set a default number of workers... (overridable by setting MAX_JOBS=N)\n"
        "Loading extension module deepspeed_shm_comm...\n"
        "error: command 'c++' failed with exit code 1\n"
    )
    assert real_lines(build) == ["error: command 'c++' failed with exit code 1"]
