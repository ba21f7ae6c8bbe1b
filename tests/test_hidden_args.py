"""clover.serving.hidden_args on a plain program (this Python): the arguments reach main, not the command line
that /proc (and ps) shows, and nothing of it is left for the program's children. tritonserver itself:
tests/test_serving_faults.py::test_the_admin_key_is_on_no_command_line_and_still_needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover.serving import hidden_args

SHOW = ("import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cmdline': open('/proc/self/cmdline', 'rb').read().decode(),\n"
        "                  'env': {k: os.environ.get(k) for k in ('LD_PRELOAD', 'CLOVER_HIDDEN_ARGS_FILE')}}))\n")


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    reason = hidden_args.unavailable_reason(Path(sys.executable).resolve())
    if reason:
        pytest.skip(reason)
    return hidden_args.build_library(tmp_path_factory.mktemp("native"))


def test_hidden_arguments_reach_main_and_not_the_command_line(tmp_path, library):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    secret = "--key=an argument nobody may read"
    path = hidden_args.hide([secret, "second"], tmp_path, env, library)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    done = subprocess.run([sys.executable, "-c", SHOW, "visible"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["visible", secret, "second"]
    assert "visible" in seen["cmdline"] and "nobody" not in seen["cmdline"]
    assert seen["env"] == {"LD_PRELOAD": None, "CLOVER_HIDDEN_ARGS_FILE": None}  # children do not load it
    assert not path.exists()


def test_an_unreadable_file_stops_the_program_before_main(tmp_path, library):
    env = dict(os.environ)
    path = hidden_args.hide(["--key=x"], tmp_path, env, library)
    path.unlink()
    done = subprocess.run([sys.executable, "-c", "print('main ran')"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "main ran" not in done.stdout and "cannot read" in done.stderr


def test_what_cannot_hide_arguments_is_named(tmp_path):
    script = tmp_path / "tritonserver"
    script.write_text("#!/bin/sh\nexec true \"$@\"\n")
    assert "not a compiled program" in hidden_args.unavailable_reason(script)
    with pytest.raises(hidden_args.HiddenArgsUnavailable, match="line break"):
        hidden_args.hide(["a\nb"], tmp_path, {}, tmp_path / "lib.so")
