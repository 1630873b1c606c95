"""
The pure parts of installing (protocol.md section 10, "Installing"): why a pip or uv
command failed, read from its real output; the environment a command runs with; the
trusted hosts; a catalog's Python range; the plan of commands; an install's query; and
which engine ids a path may name.  Nothing runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rhapsode._manage.installer import (
    check_engine_id,
    command_env,
    detect_box,
    failure_reason,
    in_range,
    install_query,
    plan,
    recipe,
    stage_sources,
    trusted_hosts,
)
from rhapsode_protocol.errors import BadRequest, Unsupported

# -- why a command failed ---------------------------------------------------------------

#: pip 26.3's output for a failed build of a package whose backend cannot find a C
#: compiler (recorded here from a local package whose build fails that way).
PIP_26_BUILD_FAILURE = """\
Looking in links: /opt/wheels
Processing ./llama-cpp-python
  Getting requirements to build wheel: started
  Getting requirements to build wheel: finished with status 'done'
  Preparing metadata (pyproject.toml): started
  Preparing metadata (pyproject.toml): finished with status 'done'
Building wheels for collected packages: llama-cpp-python
  Building wheel for llama-cpp-python (pyproject.toml): started
  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'error'
  error: subprocess-exited-with-error

  × Building wheel for llama-cpp-python (pyproject.toml) did not run successfully.
  │ exit code: 1
  ╰─> [5 lines of output]
      running build_ext
      building 'llama_cpp._ext' extension
      creating build/temp.linux-x86_64-cpython-311
      gcc -pthread -fPIC -I/usr/include/python3.11 -c llama.c -o build/llama.o
      error: command 'gcc' failed: No such file or directory
      [end of output]

  note: This error originates from a subprocess, and is likely not a problem with pip.
  ERROR: Failed building wheel for llama-cpp-python
Failed to build llama-cpp-python
error: failed-wheel-build-for-install

× Failed to build installable wheels for some pyproject.toml based projects
╰─> llama-cpp-python
"""

#: pip 23.2's ending for the same failure (the pip a Python 3.11 venv seeds).
PIP_23_ENDING = """\
  note: This error originates from a subprocess, and is likely not a problem with pip.
  ERROR: Failed building wheel for llama-cpp-python
Failed to build llama-cpp-python
ERROR: Could not build wheels for llama-cpp-python, which is required to install pyproject.toml-based projects
"""

PIP_CERTIFICATE = """\
Looking in indexes: https://pypi.org/simple
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by 'SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in certificate chain (_ssl.c:1006)'))': /simple/kokoro-onnx/
Could not fetch URL https://pypi.org/simple/kokoro-onnx/: There was a problem confirming the ssl certificate: HTTPSConnectionPool(host='pypi.org', port=443)
ERROR: Could not find a version that satisfies the requirement kokoro-onnx>=0.4 (from versions: none)
ERROR: No matching distribution found for kokoro-onnx>=0.4
"""

UV_CHAIN = """\
Using CPython 3.12.8
Creating virtual environment with seed packages at: /var/lib/rhapsode/venvs/kokoro
error: Failed to create virtualenv
  Caused by: failed to symlink file from /usr/bin/python3.12 to /var/lib/rhapsode/venvs/kokoro/bin/python
  Caused by: Permission denied (os error 13)
"""

UV_CAUSE = """\
error: Request failed after 3 retries
  cause: Failed to fetch: `https://pypi.org/simple/kokoro-onnx/`
  cause: error sending request for url (https://pypi.org/simple/kokoro-onnx/)
  cause: client error (Connect)
  cause: dns error: failed to lookup address information: Temporary failure in name resolution
"""


def test_a_pip_build_failure_is_explained_by_the_builds_output_not_its_footer() -> None:
    """
    pip 26 ends with a footer that only names the package (╰─> llama-cpp-python); the
    reason is in the build's own output above it, and the package is named after it.
    """
    reason = failure_reason(PIP_26_BUILD_FAILURE.splitlines())
    assert reason == "error: command 'gcc' failed: No such file or directory (building llama-cpp-python)"


def test_pip_23s_ending_is_passed_over_for_the_builds_output() -> None:
    """
    The older pip's last line (Could not build wheels ...) is no reason either.
    """
    lines = PIP_26_BUILD_FAILURE.split("  note:")[0].splitlines() + PIP_23_ENDING.splitlines()
    reason = failure_reason(lines)
    assert reason.startswith("error: command 'gcc' failed: No such file or directory")
    assert "building llama-cpp-python" in reason


def test_a_certificate_line_wins_over_the_last_error() -> None:
    """
    A failed certificate check is the reason, not the "No matching distribution" pip
    prints after it.
    """
    reason = failure_reason(PIP_CERTIFICATE.splitlines())
    assert "certificate" in reason.lower()
    assert "No matching distribution" not in reason


def test_without_a_build_the_last_error_line_is_the_reason() -> None:
    """
    No certificate, no build output: the last line that mentions an error.
    """
    lines = [
        "Collecting kokoro-onnx",
        "ERROR: No matching distribution found for kokoro-onnx>=9",
        "Progress 10 of 20",
        "[notice] A new release of pip is available",
    ]
    assert failure_reason(lines) == "ERROR: No matching distribution found for kokoro-onnx>=9"


def test_a_uv_error_is_told_with_its_last_cause() -> None:
    """
    uv's error: line, and the last of its Caused by: or cause: lines, the deepest.
    """
    assert failure_reason(UV_CHAIN.splitlines()) == (
        "error: Failed to create virtualenv (Caused by: Permission denied (os error 13))"
    )
    assert failure_reason(UV_CAUSE.splitlines()) == (
        "error: Request failed after 3 retries "
        "(cause: dns error: failed to lookup address information: Temporary failure in name resolution)"
    )


def test_a_uv_error_without_causes_is_its_error_line() -> None:
    """
    uv venv asked for a Python it cannot find prints one error: line; that is the reason.
    """
    lines = ["error: No interpreter found for Python >=3.15 in managed installations or search path"]
    assert failure_reason(lines) == lines[0]


def test_no_output_or_only_framing_says_it_printed_nothing() -> None:
    """
    A command that printed nothing (or only blank lines and pip's framing) is said so,
    rather than given an empty reason.
    """
    assert failure_reason([]) == "it printed nothing"
    assert failure_reason(["", "   ", "\t"]) == "it printed nothing"
    assert failure_reason(["  note: This error originates from a subprocess", "[end of output]"]) == (
        "it printed nothing"
    )


def test_without_an_error_the_last_line_is_the_reason() -> None:
    """
    An interpreter whose import failed with a traceback: its last line says why.
    """
    lines = ["Traceback (most recent call last):", '  File "<string>", line 1, in <module>',
             "ModuleNotFoundError: No module named 'rhapsode_engine_kokoro'"]
    assert failure_reason(lines) == "ModuleNotFoundError: No module named 'rhapsode_engine_kokoro'"
    assert failure_reason(["Killed"]) == "Killed"


# -- the environment --------------------------------------------------------------------


def test_a_command_env_is_built_not_inherited() -> None:
    """
    PATH, HOME, proxies, certificates and every PIP_ and UV_ variable pass; a
    virtualenv's VIRTUAL_ENV, PYTHONPATH, PYTHONHOME and PYTHONSTARTUP and anything
    else do not; unbuffered output and pip's no-prompt settings are added.
    """
    env = command_env({
        "PATH": "/usr/local/bin:/usr/bin", "HOME": "/root", "HTTPS_PROXY": "http://proxy:3128",
        "SSL_CERT_FILE": "/etc/ssl/cert.pem", "PIP_FIND_LINKS": "/opt/wheels", "PIP_CERT": "/etc/ca.pem",
        "UV_INDEX_URL": "http://index", "VIRTUAL_ENV": "/work/main/.venv", "PYTHONPATH": "/work/main/src",
        "PYTHONHOME": "/usr", "PYTHONSTARTUP": "/root/.pythonrc", "RHAPSODE_MANAGEMENT_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "x",
    })
    assert env["PATH"] == "/usr/local/bin:/usr/bin"
    assert env["PIP_FIND_LINKS"] == "/opt/wheels" and env["PIP_CERT"] == "/etc/ca.pem"
    assert env["UV_INDEX_URL"] == "http://index"
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["SSL_CERT_FILE"] == "/etc/ssl/cert.pem"
    for gone in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "RHAPSODE_MANAGEMENT_TOKEN",
                 "AWS_SECRET_ACCESS_KEY"):
        assert gone not in env
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PIP_DISABLE_PIP_VERSION_CHECK"] == "1" and env["PIP_NO_INPUT"] == "1"
    assert env["LANG"] == "C.UTF-8"


def test_a_command_env_keeps_the_locale_and_has_a_path_even_without_one() -> None:
    """
    A LANG the server has is kept; a server with no PATH gives its commands the
    default one rather than none.
    """
    env = command_env({"LANG": "de_DE.UTF-8"})
    assert env["LANG"] == "de_DE.UTF-8"
    assert env["PATH"]


def test_trusted_hosts_come_from_the_servers_environment() -> None:
    """
    RHAPSODE_PIP_TRUSTED_HOSTS, split at commas and spaces; nothing when unset or empty.
    """
    assert trusted_hosts({"RHAPSODE_PIP_TRUSTED_HOSTS": "pypi.org, files.pythonhosted.org  mirror:8080,"}) == [
        "pypi.org", "files.pythonhosted.org", "mirror:8080",
    ]
    assert trusted_hosts({}) == []
    assert trusted_hosts({"RHAPSODE_PIP_TRUSTED_HOSTS": " , "}) == []


# -- Python ranges ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, spec, inside",
    [
        ((3, 11, 7), ">=3.11,<3.14", True),
        ((3, 14, 0), ">=3.11,<3.14", False),
        ((3, 10, 12), ">=3.11,<3.14", False),
        ((3, 13, 99), ">=3.11,<3.14", True),
        ((3, 11, 7), ">=3.11", True),
        ((3, 12, 1), "==3.12", True),
        ((3, 12, 1), "!=3.12", False),
        ((3, 12, 1), "==3.12.0", False),
        ((3, 11, 0), ">3.11", False),
        ((3, 12, 0), ">3.11", True),
        ((3, 11, 9), "<=3.11", True),
        ((3, 11, 7), "", True),
        ((3, 11, 7), " >= 3.11 , < 3.14 ", True),
        ((3, 11, 7), "~=3.11", False),
        ((3, 11, 7), ">=3.11,banana", False),
    ],
)
def test_in_range(version: tuple[int, ...], spec: str, inside: bool) -> None:
    """
    A catalog's python range: comma-separated comparisons, a version compared only as
    far as the clause names it; an unreadable clause fails the check (a catalog
    defect), never passes it.
    """
    assert in_range(version, spec) is inside


# -- the plan ---------------------------------------------------------------------------

RECORD: dict[str, Any] = {
    "id": "kokoro", "module": "rhapsode_engine_kokoro", "distribution": "rhapsode-engine-kokoro",
    "python": ">=3.11,<3.14",
}


def test_the_plan_with_uv_seeds_the_venv_and_installs_in_one_resolve(tmp_path: Path) -> None:
    """
    uv venv --seed (no pip upgrade: uv seeds a current pip), then one pip install of the
    SDK and the adapter with a raw progress bar, then an import of the module.
    """
    slot = tmp_path / "venvs" / "kokoro"
    steps = plan(record=RECORD, slot=slot, source_dir=None, sdk=("/src/rhapsode/protocol", "/src/rhapsode/sdk"), uv="/usr/bin/uv",
                 interpreter="/usr/bin/python3.11", interpreter_fits=True, core_version="0.1.0")
    python = str(slot / "bin" / "python")
    assert steps.python == python
    assert steps.venv == (("/usr/bin/uv", "venv", "--seed", "--python", "/usr/bin/python3.11", str(slot)),)
    assert steps.packages == ((python, "-m", "pip", "install", "--progress-bar", "raw", "--no-input",
                               "/src/rhapsode/protocol", "/src/rhapsode/sdk", "rhapsode-engine-kokoro==0.1.0"),)
    assert steps.verify == (python, "-c", "import rhapsode_engine_kokoro")


def test_the_plan_with_uv_hands_it_the_range_when_the_interpreter_is_outside_it(tmp_path: Path) -> None:
    """
    An interpreter outside the record's range: uv is handed the range and finds one.
    """
    steps = plan(record=RECORD, slot=tmp_path / "kokoro", source_dir=None, sdk=("rhapsode-worker==0.1.0",),
                 uv="uv", interpreter="/usr/bin/python3.14", interpreter_fits=False, core_version="0.1.0")
    assert steps.venv[0][3:5] == ("--python", ">=3.11,<3.14")


def test_the_plan_without_uv_makes_a_venv_and_upgrades_its_pip_first(tmp_path: Path) -> None:
    """
    The interpreter's venv module, then pip upgraded (the pip it seeds has no
    --progress-bar raw), then the one install.
    """
    slot = tmp_path / "kokoro"
    steps = plan(record=RECORD, slot=slot, source_dir=None, sdk=("rhapsode-worker==0.1.0",), uv=None,
                 interpreter="/usr/bin/python3.11", interpreter_fits=True, core_version="0.1.0")
    python = str(slot / "bin" / "python")
    assert steps.venv == (("/usr/bin/python3.11", "-m", "venv", str(slot)),)
    assert steps.packages[0] == (python, "-m", "pip", "install", "--upgrade", "pip")
    assert steps.packages[1][:4] == (python, "-m", "pip", "install")
    assert len(steps.packages) == 2


def test_the_adapter_comes_from_the_source_dir_when_its_folder_is_there(tmp_path: Path) -> None:
    """
    <sourceDir>/<id> when it exists, whatever version it holds; otherwise the
    distribution pinned to the core's version (the id where the record names none).
    """
    source = tmp_path / "engines"
    (source / "kokoro").mkdir(parents=True)
    args: dict[str, Any] = dict(slot=tmp_path / "v", sdk=("rhapsode-worker==0.2.0",), uv=None,
                                interpreter="python3", interpreter_fits=True, core_version="0.2.0")
    assert plan(record=RECORD, source_dir=source, **args).packages[-1][-1] == str(source / "kokoro")
    piper = {"id": "piper", "module": "rhapsode_engine_piper", "distribution": "rhapsode-engine-piper"}
    assert plan(record=piper, source_dir=source, **args).packages[-1][-1] == "rhapsode-engine-piper==0.2.0"
    bare = {"id": "tone", "module": "rhapsode_engine_tone"}
    assert plan(record=bare, source_dir=None, **args).packages[-1][-1] == "tone==0.2.0"


def test_the_plan_names_each_trusted_host(tmp_path: Path) -> None:
    """
    Each trusted host is a --trusted-host before the sources; none, no option.
    """
    steps = plan(record=RECORD, slot=tmp_path / "v", source_dir=None, sdk=("sdk",), uv=None,
                 interpreter="python3", interpreter_fits=True, core_version="0.1.0",
                 trusted=["pypi.org", "mirror:8080"])
    install = steps.packages[-1]
    at = install.index("--trusted-host")
    assert install[at:at + 4] == ("--trusted-host", "pypi.org", "--trusted-host", "mirror:8080")
    assert install[-2:] == ("sdk", "rhapsode-engine-kokoro==0.1.0")
    assert install.index("--trusted-host") < install.index("sdk")


# -- the query and the id ---------------------------------------------------------------


def test_install_query_reads_each_allowed_parameter_once() -> None:
    """
    Each allowed parameter, its value or None when absent.
    """
    assert install_query({}, ("pull", "accept")) == {"pull": None, "accept": None}
    assert install_query({b"pull": [b"turbo"], b"accept": [b"CC-BY-NC-4.0"]}, ("pull", "accept")) == {
        "pull": "turbo", "accept": "CC-BY-NC-4.0",
    }


@pytest.mark.parametrize(
    "args, field",
    [
        ({b"acept": [b"MIT"]}, "acept"),
        ({b"pull": [b"a", b"b"]}, "pull"),
        ({b"accept": [b""]}, "accept"),
        ({b"pull": [b"turbo"], b"force": [b"1"]}, "force"),
    ],
)
def test_install_query_refuses_unknown_repeated_and_empty(args: dict[bytes, list[bytes]], field: str) -> None:
    """
    A misspelt parameter is refused rather than ignored (a misspelt accept must not
    install without one); repeated or empty, too; each naming the parameter.
    """
    with pytest.raises(BadRequest) as caught:
        install_query(args, ("pull", "accept"))
    assert caught.value.field == field
    assert field in caught.value.message


@pytest.mark.parametrize("good", ["kokoro", "tone-a", "my_engine", "a", "x" * 64, "Engine2"])
def test_engine_ids_that_a_path_may_name(good: str) -> None:
    """
    ASCII letters, digits, _ and -, 1 to 64 of them.
    """
    check_engine_id(good)


@pytest.mark.parametrize("bad", ["..", "../etc", "a/b", "a.b", "tone\u0435", "x" * 65, "", "tone ", "k\u200bokoro",
                                 "\u0430", "tone\n"])
def test_engine_ids_that_could_escape_or_deceive_are_refused(bad: str) -> None:
    """
    A dot, a slash, a Cyrillic letter that looks Latin, a zero-width space, a trailing
    newline (which a pattern's $ would let through), or 65 characters: bad_request
    naming the engine field.
    """
    with pytest.raises(BadRequest) as caught:
        check_engine_id(bad)
    assert caught.value.field == "engine"


def test_an_engine_is_given_the_protocol_and_the_sdk_of_the_checkout_the_core_came_from() -> None:
    """
    This core is installed from this checkout, so an engine's virtualenv gets the
    checkout's protocol and SDK folders (never the core's own distribution); a core from
    an index would name the SDK pinned to its version instead.
    """
    from rhapsode._manage.installer import sdk_source

    root = Path(__file__).resolve().parents[2]
    assert sdk_source("0.1.0") == (str(root / "protocol"), str(root / "sdk"))


# -- recipes per box --------------------------------------------------------------------

TORCH_RECORD: dict[str, Any] = {
    "id": "dia", "module": "rhapsode_engine_dia", "distribution": "rhapsode-engine-dia",
    "install": {
        "cuda": [["{sdk}", "{adapter}"]],
        "cpu": [["torch==2.13.0"], ["--no-deps", "{adapter}"], ["{sdk}"]],
    },
}


def test_a_record_with_recipes_installs_its_box_s_steps_in_order(tmp_path: Path) -> None:
    """
    On a CPU box the record's cpu recipe runs step by step, each a pip install with the
    trusted hosts, {sdk} standing for every SDK source and {adapter} for the adapter.
    """
    slot = tmp_path / "dia"
    python = str(slot / "bin" / "python")
    pip = (python, "-m", "pip", "install", "--progress-bar", "raw", "--no-input", "--trusted-host", "mirror")
    steps = plan(record=TORCH_RECORD, slot=slot, source_dir=None, sdk=("/src/protocol", "/src/sdk"), uv="uv",
                 interpreter="python3", interpreter_fits=True, core_version="0.1.0", trusted=["mirror"], box="cpu")
    assert steps.packages == (
        (*pip, "torch==2.13.0"),
        (*pip, "--no-deps", "rhapsode-engine-dia==0.1.0"),
        (*pip, "/src/protocol", "/src/sdk"),
    )
    cuda = plan(record=TORCH_RECORD, slot=slot, source_dir=None, sdk=("rhapsode-worker==0.1.0",), uv="uv",
                interpreter="python3", interpreter_fits=True, core_version="0.1.0", box="cuda")
    assert cuda.packages == ((*pip[:7], "rhapsode-worker==0.1.0", "rhapsode-engine-dia==0.1.0"),)


def test_a_record_without_a_recipe_for_the_box_is_refused_naming_install_box() -> None:
    """
    Recipes for cuda only, on a CPU box: unsupported, naming install.box and the boxes
    it installs on; a record with no recipes installs anywhere in one step.
    """
    only_cuda = {**TORCH_RECORD, "install": {"cuda": [["{sdk}", "{adapter}"]]}}
    with pytest.raises(Unsupported) as refused:
        recipe(only_cuda, "cpu", ("sdk",), "adapter")
    assert refused.value.field == "install.box"
    assert "installs on a cuda box" in str(refused.value) and "this one is a cpu box" in str(refused.value)
    assert recipe(RECORD, "cpu", ("a", "b"), "c") == [["a", "b", "c"]]


def test_the_box_is_cuda_only_where_the_kernel_lists_a_card(tmp_path: Path) -> None:
    """
    A folder of cards with one in it is a CUDA box; an empty one, or none, a CPU box.
    """
    cards = tmp_path / "gpus"
    assert detect_box(cards) == "cpu"
    cards.mkdir()
    assert detect_box(cards) == "cpu"
    (cards / "0000:01:00.0").mkdir()
    assert detect_box(cards) == "cuda"


def test_staged_sources_are_copies_without_build_leftovers_and_the_rest_is_as_given(tmp_path: Path) -> None:
    """
    Every argument naming a local folder becomes a copy under the staging folder, the
    same folder once however often it is named; build/, egg-info and caches are not
    copied, links stay links; requirements and options are left as they are.
    """
    sdk = tmp_path / "checkout" / "sdk"
    (sdk / "src" / "pkg.egg-info").mkdir(parents=True)
    (sdk / "build" / "lib").mkdir(parents=True)
    (sdk / "src" / "pkg.py").write_text("x = 1\n")
    (sdk / "setup.cfg").write_text("[metadata]\n")
    (sdk / "catalog.json").symlink_to("src/pkg.py")
    staged = tmp_path / "slot" / ".sources"
    packages = stage_sources([("pip", "install", "torch==2.13.0"), ("pip", "install", "--no-deps", str(sdk)),
                              ("pip", "install", str(sdk))], staged)
    copy = staged / "0-sdk"
    assert packages == (("pip", "install", "torch==2.13.0"), ("pip", "install", "--no-deps", str(copy)),
                        ("pip", "install", str(copy)))
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == ["catalog.json", "setup.cfg", "src", "src/pkg.py"]
    assert (copy / "catalog.json").is_symlink()
    assert (sdk / "build").is_dir() and (sdk / "src" / "pkg.egg-info").is_dir()
