"""The attach line and the frames: what the job's agent and the notebook's collector share."""

from __future__ import annotations

import pytest

from nbdist.agent import wire


def test_the_attach_line_round_trips_and_names_its_parts():
    address = wire.Address("tcp", "127.0.0.1", 9000, "abc-_9")
    assert address.line == "tcp://127.0.0.1:9000/abc-_9"
    assert wire.parse(address.line) == address
    assert wire.parse(f"NBDIST_ATTACH={address.line}\n") == address  # as printed
    six = wire.parse("tls://[::1]:443/tok")
    assert (six.scheme, six.host, six.port, six.token) == ("tls", "::1", 443, "tok")
    assert six.line == "tls://[::1]:443/tok"


@pytest.mark.parametrize("bad", ["", "127.0.0.1:9000/t", "http://h:1/t", "tcp://h:1/",
                                 "tcp://h/t", "tcp://:9000/t", "tcp://h:99999/t",
                                 "tcp://h:1/a/b"])
def test_a_malformed_line_is_refused_with_the_expected_form(bad):
    with pytest.raises(ValueError, match="tcp://HOST:PORT/TOKEN"):
        wire.parse(bad)


def test_tokens_are_fresh_and_compared_exactly():
    a, b = wire.new_token(), wire.new_token()
    assert a != b and len(a) >= 40
    assert wire.token_matches(a, a)
    assert not wire.token_matches(b, a)
    assert not wire.token_matches(a[:-1], a)
    assert not wire.token_matches(None, a) and not wire.token_matches(123, a)
    assert wire.token_tag(a) == wire.token_tag(a) != wire.token_tag(b)


def test_frames_carry_bytes_and_split_only_when_complete():
    msg = {"type": "batch", "batch": {"rank": 1, "events": [{"col": b"\x00\x01d"}]}}
    frame = wire.encode(msg)
    buf = bytearray(frame + frame[:7])
    bodies = wire.split(buf)
    assert [wire.decode(b) for b in bodies] == [msg]
    assert bytes(buf) == frame[:7]  # the partial frame waits for its rest
    buf += frame[7:]
    assert [wire.decode(b) for b in wire.split(buf)] == [msg] and not buf
    assert wire.framed(bodies[0]) == frame


def test_bytes_travel_as_messagepack_and_as_json_to_older_collectors():
    msg = {"type": "batch", "batch": {"rank": 1, "events": [
        {"a": b"\x00" * 300, "b": [b"xy", bytearray(b"z")], "c": "text", "t": (1.5, 2)}]}}
    want = {"type": "batch", "batch": {"rank": 1, "events": [
        {"a": b"\x00" * 300, "b": [b"xy", b"z"], "c": "text", "t": [1.5, 2]}]}}
    frame = wire.encode(msg)  # protocol 3: a MessagePack map, bytes raw
    assert 0x80 <= frame[4] <= 0x8F and b"\x00" * 300 in frame
    assert wire.decode(frame[4:]) == want
    two = wire.for_protocol(frame, 2)  # what a collector of protocol 2 reads
    assert two[4:5] == b"\x00" and b"\x00" * 300 in two and wire.decode(two[4:]) == want
    assert two == wire.encode(msg, 2)
    one = wire.for_protocol(frame, 1)  # ... and one of protocol 1
    assert one[4:5] == b"{" and b'"$b"' in one and wire.decode(one[4:]) == want
    assert wire.for_protocol(frame, 3) is frame and wire.for_protocol(two, 2) is two
    plain = wire.encode({"type": "bye"}, wire.JSON_PROTOCOL)
    assert wire.for_protocol(plain, 1) is plain
    # what any collector reads: the hello is JSON whatever the protocol
    assert wire.hello("tok", "h", 1)[4:5] == b"{"
    assert wire.decode(wire.hello("tok", "h", 1)[4:])["nbdist"] == wire.PROTOCOL
    # a body that names bytes it does not hold, or is cut short, is refused, not read past
    # its end
    with pytest.raises(ValueError, match="does not hold"):
        wire.decode(two[4:-1])
    with pytest.raises(ValueError, match="MessagePack"):
        wire.decode(frame[4:-1])


def test_integers_beyond_64_bits_go_as_json_and_unknown_values_are_refused():
    big = {"type": "batch", "n": 1 << 70, "b": b"\x01"}
    frame = wire.encode(big)
    assert frame[4:5] == b"\x00" and wire.decode(frame[4:]) == big
    assert wire.decode(wire.encode({"s": {3}})[4:]) == {"s": [3]}
    with pytest.raises(TypeError, match="cannot send object"):
        wire.encode({"x": object()})


def test_a_frame_longer_than_the_limit_is_refused():
    with pytest.raises(ValueError, match="more than 10"):
        wire.split(bytearray(wire.encode({"x": "y" * 20})), limit=10)
    with pytest.raises(ValueError):
        wire.decode(b"[1, 2]")


def test_the_job_key_comes_from_the_launcher():
    assert wire.job_key({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"}) == "torchrun-abc"
    assert wire.job_key({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}) == "slurm-7"
    # each srun of a batch job is a job step, as sacct names it
    assert wire.job_key({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}) == "slurm-7.2"
    assert wire.job_key({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == "h:29500"
    assert wire.job_key({}) is None
