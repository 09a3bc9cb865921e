"""The Docker actuator's pure parts: which replicas a scale-down removes, what the next replica is
called and numbered, the create request copied from an inspected replica, finding one's own
container id. The engine itself is exercised for real in tests/e2e/test_compose_up.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tandem.services.planner.actuator import ActuatorError
from tandem.services.planner.docker_actuator import (
    NUMBER_LABEL,
    DockerActuator,
    Replica,
    choose_victims,
    container_number,
    create_body,
    in_compose_container,
    next_number,
    own_container_ids,
    replica_from_listing,
    replica_name,
    service_runs,
    socket_path,
)

ID_A = "8b0fe671bb433d5c57c5356052212b1335d0a064fe9d5a2bc6d63a2848e02290"
ID_B = "374f1b125836f3b65d88125af2907f0c8015f2766b7f82441524fbe24b7a3d26"
LAYER = "4f7a0d1c9e2b3a5f6d8c0e1b2a3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e"

# The parts of a real `GET /containers/{id}/json` of compose's decode replica (docker.io 20.10,
# docker-compose 1.29) that the copy reads.
INSPECTED = {
    "Id": ID_A,
    "Name": "/tandemtest_decode_1",
    "Image": "sha256:5b2c6c0d7a4a8e1f3b9d0c2e4f6a8b0c1d3e5f7a9b1c3d5e7f9a0b2c4d6e8f0a",
    "Config": {
        "Hostname": "8b0fe671bb43", "Domainname": "", "User": "tandem", "Image": "tandem:latest",
        "Cmd": ["tandem", "serve", "decode"], "Entrypoint": None, "WorkingDir": "/data", "StopTimeout": 40,
        "Env": ["TANDEM_NATS_URL=nats://nats:4222", "TANDEM_NATS_CREDS=/auth/decode.key", "TANDEM_KV_RING_MIB=0"],
        "Labels": {
            "com.docker.compose.config-hash": "6fc73528bd834f413d7a91bb27d3c3658d3e154ce02e96ded862fb54842f8f61",
            "com.docker.compose.container-number": "1", "com.docker.compose.oneoff": "False",
            "com.docker.compose.project": "tandemtest", "com.docker.compose.service": "decode",
            "com.docker.compose.version": "1.29.2",
        },
    },
    "HostConfig": {
        "Binds": ["/tmp/models:/data/models:ro", "tandemtest_trainer-data:/data/train:ro", "tandemtest_auth:/auth:ro"],
        "NetworkMode": "tandemtest_default", "RestartPolicy": {"Name": "unless-stopped", "MaximumRetryCount": 0},
        "Init": True, "ShmSize": 67108864,
    },
    "NetworkSettings": {"Networks": {
        "tandemtest_default": {
            "IPAMConfig": None, "Links": None, "Aliases": ["8b0fe671bb43", "decode"],
            "NetworkID": "d9d9cd26a1cb289cf24c5b3a0875f2c5dcc31aa87e91c7c232d4709b8bc03b9c",
            "EndpointID": "d542c32c1dfa2ff5bdce262c6ce640b2f50267c7285d0e907abb05800331dd2e",
            "Gateway": "172.18.0.1", "IPAddress": "172.18.0.7", "IPPrefixLen": 16, "MacAddress": "02:42:ac:12:00:07",
        },
    }},
}


def replica(number: int, created: int = 0, state: str = "running", name: str = "") -> Replica:
    return Replica(id=f"{number:064x}", name=name or f"p_decode_{number}", number=number, created=created, state=state)


def test_victims_are_the_newest_running_replicas() -> None:
    replicas = [replica(1, 100), replica(3, 300), replica(2, 200), replica(4, 400, state="exited")]
    assert [r.number for r in choose_victims(replicas, 2)] == [3, 2], "the highest numbers that run go first"
    assert choose_victims(replicas, 0) == [] and choose_victims(replicas, -1) == []
    assert [r.number for r in choose_victims(replicas, 9)] == [3, 2, 1], "never more than run, nor a stopped one"


def test_victims_tie_on_number_goes_to_the_latest_created() -> None:
    replicas = [replica(2, 100, name="a"), replica(2, 500, name="b"), replica(1, 900)]
    assert [r.name for r in choose_victims(replicas, 1)] == ["b"]


def test_a_restarting_replica_counts_and_may_go() -> None:
    replicas = [replica(1), replica(2, state="restarting")]
    assert [r.number for r in choose_victims(replicas, 1)] == [2]


def test_next_number_passes_stopped_containers_too() -> None:
    assert next_number([]) == 1
    assert next_number([replica(1), replica(4, state="exited"), replica(2)]) == 5, \
        "a stopped container still holds its name: the number past every one"


def test_replica_name_follows_the_copied_one() -> None:
    assert replica_name(replica(2, name="proj_decode_2"), 3, "proj", "decode") == "proj_decode_3"  # compose 1
    assert replica_name(replica(1, name="proj-decode-1"), 7, "proj", "decode") == "proj-decode-7"  # compose 2
    assert replica_name(replica(1, name="my-decoder"), 2, "proj", "decode") == "proj-decode-2", \
        "a name that does not end in its own number gets compose 2's form"
    assert replica_name(replica(2, name="proj_decode-gpu_2"), 3, "proj", "decode-gpu") == "proj_decode-gpu_3"


def test_listing_entries_become_replicas() -> None:
    entry = {"Id": ID_B, "Names": ["/tandemtest_decode_2"], "Created": 1796158435, "State": "running",
             "Labels": {NUMBER_LABEL: "2"}, "Command": "tandem serve decode"}
    assert replica_from_listing(entry) == Replica(ID_B, "tandemtest_decode_2", 2, 1796158435, "running")
    assert container_number({NUMBER_LABEL: "x"}) == 0 and container_number(None) == 0


def test_service_runs_reads_the_command() -> None:
    assert service_runs("tandem serve decode", "decode")
    assert service_runs(["tandem", "serve", "prefill"], "prefill")
    assert not service_runs("tandem serve prefill", "decode")
    assert not service_runs("tandem auth init /auth --keep", "decode") and not service_runs(None, "decode")


def test_create_body_copies_the_service_not_the_container() -> None:
    body, more = create_body(INSPECTED, 3)
    assert body["Labels"][NUMBER_LABEL] == "3", "the new replica carries its own container number"
    assert body["Labels"]["com.docker.compose.project"] == "tandemtest" and \
        body["Labels"]["com.docker.compose.service"] == "decode", "compose's labels make it the service's own"
    assert "Hostname" not in body and "Domainname" not in body, \
        "the copy must get a hostname of its own: workers drain by the host they beat with"
    assert body["Cmd"] == ["tandem", "serve", "decode"] and body["Env"] == INSPECTED["Config"]["Env"]
    assert body["Image"] == INSPECTED["Image"], "the image the replica runs, by id: a rebuilt tag would mix versions"
    assert body["HostConfig"]["Binds"] == INSPECTED["HostConfig"]["Binds"]
    assert body["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped" and body["HostConfig"]["Init"] is True
    endpoint = body["NetworkingConfig"]["EndpointsConfig"]["tandemtest_default"]
    assert endpoint["Aliases"] == ["decode"], "reachable by the service's name, not the copied one's short id"
    assert not {"IPAddress", "EndpointID", "MacAddress", "NetworkID"} & set(endpoint), "those are the engine's to give"
    assert more == {}
    assert INSPECTED["Config"]["Labels"][NUMBER_LABEL] == "1" and "Hostname" in INSPECTED["Config"], \
        "the inspected replica is left as it was"


def test_create_body_with_two_networks_connects_the_second_after() -> None:
    inspected = {**INSPECTED, "NetworkSettings": {"Networks": {
        "tandemtest_default": {"Aliases": ["x"], "IPAddress": "172.18.0.7"},
        "tandemtest_gpu": {"Aliases": ["y"], "IPAddress": "172.19.0.7"},
    }}}
    body, more = create_body(inspected, 2)
    assert list(body["NetworkingConfig"]["EndpointsConfig"]) == ["tandemtest_default"], \
        "the create takes the NetworkMode's network (older engine APIs take one)"
    assert more == {"tandemtest_gpu": {"Aliases": ["decode"]}}


def test_own_container_id_from_mountinfo_not_from_image_layers() -> None:
    mountinfo = (
        f"700 650 0:51 / / rw,relatime master:300 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/ABC,"
        f"upperdir=/var/lib/docker/overlay2/{LAYER}/diff,workdir=/var/lib/docker/overlay2/{LAYER}/work\n"
        f"720 700 254:0 /var/lib/docker/containers/{ID_A}/resolv.conf /etc/resolv.conf rw,relatime - ext4 /dev/vda rw\n"
        f"721 700 254:0 /var/lib/docker/containers/{ID_A}/hostname /etc/hostname rw,relatime - ext4 /dev/vda rw\n")
    assert own_container_ids(mountinfo) == [ID_A]
    assert own_container_ids("", f"12:memory:/docker/{ID_B}\n0::/system.slice/docker-{ID_B}.scope\n") == [ID_B]
    assert own_container_ids("22 1 254:0 / / rw - ext4 /dev/vda rw\n", "0::/\n") == [], "on a host: none"


def test_socket_path_honours_a_unix_docker_host() -> None:
    assert socket_path({}) == "/var/run/docker.sock"
    assert socket_path({"DOCKER_HOST": "unix:///run/d/docker.sock"}) == "/run/d/docker.sock"
    assert socket_path({"DOCKER_HOST": "tcp://10.0.0.1:2375"}) == "/var/run/docker.sock"


def test_no_socket_means_no_compose_actuator(tmp_path) -> None:
    missing = str(tmp_path / "docker.sock")
    assert in_compose_container(missing) is False
    with pytest.raises(ActuatorError, match="no Docker socket at .*mount it into the planner container"):
        asyncio.run(DockerActuator.from_environment(socket_file=missing))
    (tmp_path / "plain").write_text("")
    with pytest.raises(ActuatorError, match="is not a socket"):
        asyncio.run(DockerActuator.from_environment(socket_file=str(tmp_path / "plain")))


def test_an_engine_that_does_not_answer_is_one_line(tmp_path) -> None:
    path = str(tmp_path / "dead.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)  # bound, never listening: connections are refused

    async def ask() -> None:
        actuator = DockerActuator("p", socket_file=path)
        try:
            await actuator.replicas("decode")
        finally:
            await actuator.close()

    try:
        with pytest.raises(ActuatorError, match=r"cannot reach the Docker engine at .*dead.sock"):
            asyncio.run(ask())
    finally:
        server.close()


def test_scaling_below_zero_is_refused() -> None:
    async def scale() -> None:
        actuator = DockerActuator("p", socket_file="/nonexistent.sock")
        try:
            await actuator.scale("decode", -1, lambda hosts: None)
        finally:
            await actuator.close()

    with pytest.raises(ActuatorError, match="ask for 0 or more"):
        asyncio.run(scale())
