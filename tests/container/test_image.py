"""
The container image, built from this checkout and run with podman as an operator would: a
fresh volume, engines installed through the API inside the container, real audio fetched
from the host over loopback, a new container on the same volume finding what the first one
installed, and a SIGTERM stop that ends the server and its workers before podman's grace
runs out.  The image is built by tools/container/build.sh, as `make image` builds it (its
layers, its Debian base and pip's downloads are cached in podman's storage, so a second
run builds in seconds).  Skipped, saying why, where podman is not installed (`make test`
installs it from Debian's packages where it can).  Selected with `-m container`.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
import uuid
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
CORE = f"localhost/rhapsode:{VERSION}"
ENGINES = f"localhost/rhapsode:{VERSION}-engines"
TOKEN = "container-test-" + uuid.uuid4().hex
#: The host's CA bundle: on these machines PyPI is reached through a TLS-intercepting proxy
#: whose CA only the host's bundle has; pip inside the container is handed it this way.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
#: Hang guards, generous for a box ten times slower: never a measure of speed.
BUILD_LIMIT = 3600
INSTALL_LIMIT = 1200
START_LIMIT = 180
STOP_GRACE = 60


def podman_flags() -> list[str]:
    """The flags this machine needs (runc, limits), from the script the build uses."""
    script = '. tools/container/podman-flags.sh; printf "%s\\n" "${RHAPSODE_PODMAN_FLAGS[@]}"'
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr[-3000:]}")
    return done


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, method: str = "GET", body: bytes | None = None, *, token: str | None = None,
            content_type: str = "application/json", timeout: float = 120) -> Answer:
    headers = {"Content-Type": content_type} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    call = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=timeout) as answer:
            return Answer(answer.status, answer.read(), dict(answer.headers))
    except urllib.error.HTTPError as refused:
        return Answer(refused.code, refused.read(), dict(refused.headers))


@dataclass
class Box:
    """One container of the image on a volume, its port published on the host's loopback."""

    image: str
    volume: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)
    name: str = field(default_factory=lambda: "rhapsode-test-" + uuid.uuid4().hex[:10])
    port: int = field(default_factory=free_port)
    started: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self) -> None:
        args = ["run", "-d", "--name", self.name, *self.flags, "--health-interval", "disable",
                "-p", f"127.0.0.1:{self.port}:8080", "-v", f"{self.volume}:/var/lib/rhapsode"]
        if HOST_CA.is_file():
            args += ["-v", f"{HOST_CA}:/run/host-ca.pem:ro", "-e", "RHAPSODE_CA_FILE=/run/host-ca.pem"]
        for mount in self.mounts:
            args += ["-v", mount]
        for name, value in self.env.items():
            args += ["-e", f"{name}={value}"]
        self.started = time.monotonic()
        podman(*args, self.image)

    def wait_up(self) -> None:
        deadline = time.monotonic() + START_LIMIT
        while True:
            try:
                if request(self.url + "/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            if self.state()["Status"] != "running" or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not answer /health:\n{self.logs()}")
            time.sleep(0.1)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(podman("inspect", "--format", "{{json .State}}", self.name).stdout)
        return state

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def stop(self) -> float:
        """podman stop with a grace past the server's own; the seconds the stop took."""
        started = time.monotonic()
        podman("stop", "-t", str(STOP_GRACE), self.name, timeout=STOP_GRACE + 60)
        return time.monotonic() - started

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture(scope="module")
def flags() -> list[str]:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed, and `make test` could not install it here "
                    "(it installs podman, runc and debootstrap with apt-get as root)")
    return podman_flags()


@pytest.fixture(scope="module")
def images(flags: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both tags built from this checkout by tools/container/build.sh."""
    log = tmp_path_factory.mktemp("build") / "build.log"
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run([str(ROOT / "tools/container/build.sh"), "all"], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, timeout=BUILD_LIMIT)
    text = log.read_text(errors="replace")
    assert done.returncode == 0, f"tools/container/build.sh exited {done.returncode}:\n{text[-6000:]}"
    inspected = {tag: json.loads(podman("image", "inspect", tag).stdout)[0] for tag in (CORE, ENGINES)}
    print(f"\nimage build: {time.monotonic() - started:.0f} s; "
          + "; ".join(f"{tag} {facts['Size'] / 1e6:.0f} MB" for tag, facts in inspected.items()))
    return inspected


@pytest.fixture(scope="module")
def volume(flags: list[str]) -> Iterator[str]:
    name = "rhapsode-test-" + uuid.uuid4().hex[:10]
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An operator's config, mounted read-only over the image's /etc/rhapsode."""
    folder = tmp_path_factory.mktemp("etc-rhapsode")
    (folder / "rhapsode.json").write_text(json.dumps({"limits": {"queuedPerEngine": 7}}))
    folder.chmod(0o755)
    (folder / "rhapsode.json").chmod(0o644)
    return folder


class Boxes:
    """The containers a test module starts, each removed at its end whatever happened."""

    def __init__(self, flags: list[str]) -> None:
        self.flags = flags
        self.started: list[Box] = []

    def start(self, image: str, volume: str, **kwargs: Any) -> Box:
        box = Box(image, volume, self.flags, **kwargs)
        self.started.append(box)
        box.run()
        box.wait_up()
        return box


@pytest.fixture(scope="module")
def boxes(flags: list[str]) -> Iterator[Boxes]:
    made = Boxes(flags)
    yield made
    for box in made.started:
        box.remove()


def core_box(boxes: Boxes, volume: str, config_file: Path) -> Box:
    return boxes.start(
        CORE, volume,
        env={"RHAPSODE_CONFIG_MANAGEMENT_TOKEN": TOKEN, "RHAPSODE_CONFIG_LIMITS_CONCURRENT_PER_ENGINE": "3"},
        mounts=[f"{config_file}:/etc/rhapsode:ro"],
    )


@pytest.fixture(scope="module")
def first(images: dict[str, Any], boxes: Boxes, volume: str, config_file: Path) -> Box:
    """The core tag on a fresh volume."""
    return core_box(boxes, volume, config_file)


def install(box: Box, engine: str) -> dict[str, Any]:
    """POST /engines/{id}/install with the token, then the job followed to its end."""
    answer = request(f"{box.url}/engines/{engine}/install", "POST", b"", token=TOKEN)
    assert answer.status == 202, answer.body
    job = answer.json()
    deadline = time.monotonic() + INSTALL_LIMIT
    while job["state"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"install {engine} still {job['state']}:\n{box.logs()[-4000:]}"
        time.sleep(0.5)
        job = request(f"{box.url}/installs/{job['id']}", token=TOKEN).json()
    return dict(job)


@pytest.fixture(scope="module")
def installed(first: Box) -> dict[str, dict[str, Any]]:
    """espeak and tone installed through the API of the first container."""
    return {engine: install(first, engine) for engine in ("espeak", "tone")}


def wav_of(body: bytes) -> tuple[int, int, float]:
    """A WAV's sample rate, frame count and RMS level (16-bit mono)."""
    with wave.open(io.BytesIO(body)) as clip:
        assert clip.getsampwidth() == 2 and clip.getnchannels() == 1
        rate, frames = clip.getframerate(), clip.readframes(clip.getnframes())
    samples = struct.unpack(f"<{len(frames) // 2}h", frames)
    rms = math.sqrt(sum(s * s for s in samples) / len(samples)) if samples else 0.0
    return rate, len(samples), rms


def speak(box: Box, **fields: Any) -> bytes:
    answer = request(box.url + "/speak", "POST", json.dumps({"stream": False, "format": "wav", **fields}).encode())
    assert answer.status == 200, answer.body
    assert answer.headers.get("Content-Type", "").startswith("audio/wav")
    return answer.body


def assert_speech(box: Box, engine: str, body: bytes) -> None:
    """Audio at the engine's own rate, long enough to be a sentence, and not silence."""
    native = request(f"{box.url}/engines/{engine}/capabilities").json()["nativeFormat"]
    rate, samples, rms = wav_of(body)
    assert rate == native["sampleRate"]
    assert samples > rate // 2, f"{samples} samples at {rate} Hz is under half a second"
    assert rms > 300, f"RMS {rms:.0f}: silence"


def sine_wav(frequency: float, seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A voiced-sounding reference clip: a fundamental and two harmonics."""
    frames = bytearray()
    for n in range(int(seconds * rate)):
        t = n / rate
        value = 0.5 * math.sin(2 * math.pi * frequency * t) + 0.25 * math.sin(4 * math.pi * frequency * t)
        frames += struct.pack("<h", int((value + 0.12 * math.sin(6 * math.pi * frequency * t)) * 20000))
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(bytes(frames))
    return out.getvalue()


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    for name, (filename, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     "Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def test_both_tags_run_the_server_as_a_non_root_user_under_tini(images: dict[str, Any]) -> None:
    """
    Each tag runs `rhapsode serve` as the user rhapsode (uid 10001) under tini, keeps its
    state in the volume /var/lib/rhapsode, publishes 8080 and carries a HEALTHCHECK that
    asks /health.
    """
    for tag, facts in images.items():
        config = facts["Config"]
        assert config["User"] == "rhapsode", tag
        assert config["Cmd"] == ["rhapsode", "serve"], tag
        assert config["Entrypoint"][0] == "/usr/bin/tini", tag
        assert "/var/lib/rhapsode" in config["Volumes"], tag
        assert "8080/tcp" in config["ExposedPorts"], tag
        # podman's inspect puts it beside Config (docker's, inside): the docker format kept it.
        check = facts.get("Healthcheck") or config.get("Healthcheck")
        assert check["Test"] == ["CMD", "rhapsode-container", "health"], tag


def test_the_server_takes_config_from_a_mounted_file_and_the_environment(first: Box) -> None:
    """
    A file mounted at /etc/rhapsode/rhapsode.json and RHAPSODE_CONFIG_* variables both
    reach the server: GET /settings (with the token from the variables) shows both values.
    """
    settings = request(first.url + "/settings", token=TOKEN)
    assert settings.status == 200, settings.body
    limits = settings.json()["values"]["limits"]
    assert limits["queuedPerEngine"] == 7
    assert limits["concurrentPerEngine"] == 3
    logs = first.logs()
    assert "config from /etc/rhapsode/rhapsode.json" in logs
    assert TOKEN not in logs


def test_management_from_the_host_needs_the_token(first: Box) -> None:
    """
    The server listens on every interface inside the container, so a caller on the host
    is remote to it: an install without the token is refused 403, naming the rule.
    """
    answer = request(first.url + "/engines/espeak/install", "POST", b"")
    assert answer.status == 403
    assert answer.json()["error"]["code"] == "forbidden"


def test_engines_install_through_the_api_into_the_volume(first: Box, installed: dict[str, dict[str, Any]]) -> None:
    """
    POST /engines/{id}/install, run inside the container, builds espeak's and tone's
    virtualenvs in the volume (pip reaching PyPI from inside), and the server serves them.
    """
    for engine, job in installed.items():
        assert job["state"] == "succeeded", f"{engine}: {job}\n{first.logs()[-4000:]}"
    listed = {entry["id"] for entry in request(first.url + "/engines").json()}
    assert {"espeak", "tone"} <= listed
    venvs = podman("exec", first.name, "ls", "/var/lib/rhapsode/venvs").stdout.split()
    assert {"espeak", "tone"} <= set(venvs)


def test_espeak_speaks_real_audio_to_the_host(first: Box, installed: dict[str, dict[str, Any]]) -> None:
    """/speak from the host over loopback answers a WAV of speech at espeak's rate."""
    assert_speech(first, "espeak", speak(first, engine="espeak", text="Hello from inside a container."))


def test_a_voice_created_through_the_api_speaks(first: Box, installed: dict[str, dict[str, Any]]) -> None:
    """A tone voice cloned from an uploaded clip is created (201), listed, and speaks."""
    body, ctype = multipart({"id": "boxed", "label": "Boxed"}, {"reference": ("clip.wav", sine_wav(140.0))})
    created = request(first.url + "/engines/tone/voices", "POST", body, token=TOKEN, content_type=ctype)
    assert created.status == 201, created.body
    assert "boxed" in [voice["id"] for voice in request(first.url + "/engines/tone/voices").json()]
    assert_speech(first, "tone", speak(first, engine="tone", voice="boxed", text="Kept in the volume."))


def test_the_health_check_passes_while_serving(first: Box) -> None:
    """The image's HEALTHCHECK command, run by podman, finds the server healthy."""
    done = podman("healthcheck", "run", first.name, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_sigterm_stops_the_server_and_its_workers_within_the_grace(first: Box,
                                                                    installed: dict[str, dict[str, Any]]) -> None:
    """
    podman stop sends SIGTERM; the server drains, stops each worker it started, and exits
    before the grace ends: exit status 0 (tini's for a server ended by SIGTERM), not 137
    (SIGKILL), each worker's own exit logged, and no process of the container left.
    """
    speak(first, engine="espeak", text="One more before the stop.")
    seconds = first.stop()
    state = first.state()
    logs = first.logs()
    assert state["Status"] == "exited"
    assert state["ExitCode"] == 0, logs[-4000:]
    assert seconds < STOP_GRACE, f"the stop took {seconds:.1f} s: podman's SIGKILL, not the server's own stop"
    assert "worker espeak stopped (exit code 0)" in logs
    assert "rhapsode stopped" in logs
    container_id = podman("inspect", "--format", "{{.Id}}", first.name).stdout.strip()
    first.remove()
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and container_id.encode() in (proc / "cmdline").read_bytes():
                left.append(proc.name)
        except OSError:
            continue
    assert not left, f"processes of the container still running: {left}"


def test_a_new_container_on_the_volume_finds_the_engines_and_the_voice(
    first: Box, installed: dict[str, dict[str, Any]], boxes: Boxes, volume: str, config_file: Path
) -> None:
    """
    A new container of the image on the same volume serves the engines the first one
    installed and the voice it created, with no install: they live in the volume, not in
    the container.
    """
    first.remove()
    second = core_box(boxes, volume, config_file)
    listed = {entry["id"] for entry in request(second.url + "/engines").json()}
    assert {"espeak", "tone"} <= listed
    voices = {voice["id"]: voice for voice in request(second.url + "/engines/tone/voices").json()}
    assert "boxed" in voices
    assert_speech(second, "tone", speak(second, engine="tone", voice="boxed", text="Still here."))
    assert_speech(second, "espeak", speak(second, engine="espeak", text="Still installed."))
    second.stop()
    assert second.state()["ExitCode"] == 0


def test_the_engines_tag_speaks_at_once_on_a_fresh_volume(images: dict[str, Any], boxes: Boxes, flags: list[str]) -> None:
    """
    The engines tag on a new volume lists tone, espeak and piper with no install (the
    volume starts as a copy of the image's), and piper speaks real audio at its rate.
    """
    name = "rhapsode-test-" + uuid.uuid4().hex[:10]
    podman("volume", "create", name)
    try:
        box = boxes.start(ENGINES, name)
        listed = {entry["id"] for entry in request(box.url + "/engines").json()}
        assert {"tone", "espeak", "piper"} <= listed
        assert_speech(box, "piper", speak(box, engine="piper", text="Hello from a baked image."))
        print(f"\nengines tag: podman run to first piper audio {time.monotonic() - box.started:.1f} s (fresh volume)")
        box.stop()
        assert box.state()["ExitCode"] == 0
        box.remove()
    finally:
        podman("volume", "rm", "-f", name, check=False)
