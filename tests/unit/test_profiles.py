"""Profiles: the schema, errors that point at the file, line and key, and the round trip to
the option records the session runs on."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nbdist.errors import OptionError, ProfileError
from nbdist.options import CellDefaults, ClusterOptions, LaunchOptions, Measure
from nbdist.profiles import (
    _LAYOUTS,
    _TREE,
    Profile,
    dump_profile,
    from_options,
    load_profile,
    parse_profile,
    to_options,
)
from nbdist.runtime.measure.spec import DDPSettings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "profiles"


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_every_key_reaches_its_field(tmp_path):
    path = write(tmp_path, """
        cluster:
          engine: dask
          workers: 3
          launcher: ssh
          listen: 10.0.0.1
          hosts: {a: 2, b: 1}
          resources:
            cpus: 4
            memory: 8GB
            gpus: 0
            queue: q
            account: acc
            walltime: "01:00:00"
            image: img:1
            options: {connect_options: {known_hosts: null}}
        runtime:
          device: cpu
          dist_backend: gloo
          threads: 2
          timeout: 60
          env: {NCCL_IB_DISABLE: 1, NAME: x}
          working_dir: /scratch
        training:
          output: all
          telemetry: false
          collective_timing: false
          bucket_timing: true
          stall_after: 20
          cell_timeout: 30
          elastic: {max_failures: 2}
    """)
    options, defaults = to_options(load_profile(path))
    launch = LaunchOptions(launcher="ssh", listen="10.0.0.1", hosts={"a": 2, "b": 1}, cpus=4,
                           memory="8GB", gpus=0, queue="q", account="acc", walltime="01:00:00",
                           image="img:1", options={"connect_options": {"known_hosts": None}})
    assert options == ClusterOptions(engine="dask", n=3, device="cpu", dist_backend="gloo",
                                     threads=2, timeout=60.0, launch=launch,
                                     env={"NCCL_IB_DISABLE": "1", "NAME": "x"},
                                     working_dir="/scratch")
    measure = Measure(telemetry=False, collectives=False, buckets=True, stall_after=20.0)
    assert defaults == CellDefaults(output="all", measure=measure, timeout=30.0,
                                    elastic_max_failures=2)


def test_each_key_sets_one_field_and_the_layout_is_the_documented_one():
    keys = [".".join(k) for layout in _LAYOUTS for _, k in layout]
    assert len(keys) == len(set(keys))
    assert list(_TREE) == ["cluster", "runtime", "training"]
    assert list(_TREE["cluster"]) == ["engine", "workers", "launcher", "listen", "hosts",
                                      "resources", "template"]
    assert list(_TREE["runtime"]) == ["device", "dist_backend", "threads", "timeout", "env",
                                      "working_dir"]
    assert list(_TREE["training"]) == ["output", "telemetry", "collective_timing",
                                       "bucket_timing", "stall_after", "ddp", "cell_timeout",
                                       "elastic"]
    assert list(_TREE["training"]["ddp"]) == ["bucket_cap_mb", "gradient_as_bucket_view",
                                              "static_graph", "comm_hook"]


def test_a_profile_carries_a_ddp_setting_and_writes_it_back(tmp_path):
    profile = load_profile(write(tmp_path, """
        training:
          ddp: {bucket_cap_mb: 5, gradient_as_bucket_view: true}
    """))
    ddp = to_options(profile)[1].measure.ddp
    assert ddp == DDPSettings(bucket_cap_mb=5.0, gradient_as_bucket_view=True)
    text = dump_profile(profile)
    assert "ddp:" in text and "bucket_cap_mb: 5.0" in text and "comm_hook" not in text
    assert load_profile(write(tmp_path, text, "again.yaml")) == profile


@pytest.mark.parametrize("body, message", [
    ("ddp: {comm_hook: fp61}", "did you mean 'fp16'"),
    ("ddp: {bucket_cap_mb: 0}", "bucket_cap_mb must be positive"),
    ("ddp: {bucket: 5}", "did you mean 'bucket_cap_mb'"),
])
def test_a_bad_ddp_setting_names_its_key(tmp_path, body, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(write(tmp_path, f"training:\n  {body}\n"))


def test_an_empty_profile_is_the_defaults(tmp_path):
    options, defaults = to_options(load_profile(write(tmp_path, "")))
    assert options == ClusterOptions() and defaults == CellDefaults()


def test_hosts_as_a_list_or_a_mapping_give_the_worker_count(tmp_path):
    listed = load_profile(write(tmp_path, """
        cluster: {launcher: ssh, listen: 10.0.0.1, hosts: [a, b, c]}
    """, "l.yaml"))
    mapped = load_profile(write(tmp_path, """
        cluster: {launcher: ssh, listen: 10.0.0.1, hosts: {a: 2, b: 4}}
    """, "m.yaml"))
    assert to_options(listed)[0].n == 3 and dict(to_options(listed)[0].launch.hosts) == {
        "a": 1, "b": 1, "c": 1}
    assert to_options(mapped)[0].n == 6


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_profiles_are_valid(name):
    profile = load_profile(EXAMPLES / name)
    options, _ = to_options(profile)
    assert options.n and options.n >= 2


def test_the_examples_cover_what_the_docs_promise():
    launchers = {load_profile(p).options.launch.launcher for p in EXAMPLES.glob("*.yaml")}
    engines = {load_profile(p).options.engine for p in EXAMPLES.glob("*.yaml")}
    assert {"local", "slurm", "kubernetes"} <= launchers and engines == {"ipyparallel", "dask"}


# ------------------------------------------------------------------------------ errors
def problem(tmp_path: Path, text: str) -> ProfileError:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    err = info.value
    assert str(err).endswith("Nothing was started.")
    assert isinstance(err, OptionError)  # the magics show it as a usage error
    return err


def test_unknown_key_names_file_line_key_and_the_nearest_valid_key(tmp_path):
    err = problem(tmp_path, """
        cluster:
          engine: dask
          workrs: 4
    """)
    assert err.problems == [(4, "cluster.workrs", err.problems[0][2])]
    msg = str(err)
    assert f"{tmp_path / 'p.yaml'}, line 4: cluster.workrs: unknown key; did you mean " \
           "'workers'?" in msg
    assert "engine, workers, launcher" in msg


def test_unknown_section_suggests_the_section(tmp_path):
    err = problem(tmp_path, "runtme:\n  device: cpu\n")
    assert "line 1: runtme: unknown key; did you mean 'runtime'?" in str(err)


def test_a_section_is_a_mapping_or_left_empty(tmp_path):
    err = problem(tmp_path, "cluster: 4\n")
    assert "line 1: cluster: a section of keys (engine, workers" in str(err)
    assert to_options(parse_profile("cluster:\ntraining:\n  elastic:\n")) == (
        ClusterOptions(), CellDefaults())


def test_wrong_type_names_the_line_and_the_value(tmp_path):
    err = problem(tmp_path, """
        cluster:
          workers: 2
        runtime:
          threads: many
    """)
    assert len(err.problems) == 1
    line, key, msg = err.problems[0]
    assert (line, key) == (5, "runtime.threads")
    assert "valid integer" in msg and "'many'" in msg


def test_wrong_choice_suggests_the_nearest(tmp_path):
    err = problem(tmp_path, "cluster:\n  launcher: slurmm\n")
    assert ("line 2: cluster.launcher: unknown launcher 'slurmm': choose one of local, ssh"
            in str(err))
    assert "did you mean 'slurm'?" in str(err)
    # engines, too, are the registered ones
    err = problem(tmp_path, "cluster:\n  engine: daks\n")
    assert "line 2: cluster.engine: unknown engine 'daks': choose one of ipyparallel, dask; " \
           "did you mean 'dask'?" in str(err)


def test_every_problem_is_listed_once_in_line_order(tmp_path):
    err = problem(tmp_path, """
        training:
          output: loud
        cluster:
          workers: 0
    """)
    assert [p[0] for p in err.problems] == [3, 5]
    assert "(2 problems)" in str(err)


def test_unquoted_env_values_that_are_not_text_say_to_quote(tmp_path):
    err = problem(tmp_path, "runtime:\n  env:\n    FLAG: yes\n")
    assert "line 3: runtime.env.FLAG" in str(err) and "quote it" in str(err)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"nope\.yaml: no such file"):
        load_profile(tmp_path / "nope.yaml")


def test_bad_yaml_names_the_line(tmp_path):
    err = problem(tmp_path, "cluster:\n  engine: [dask\n")
    assert "not valid YAML" in str(err) and err.problems[0][0] is not None


def test_not_a_mapping(tmp_path):
    err = problem(tmp_path, "- cluster\n")
    assert "a profile is a mapping" in str(err)


@pytest.mark.parametrize("text,line,key,message", [
    # unknown keys, in every section
    ("training:\n  elastic:\n    min_workers: 2\n", 3, "training.elastic.min_workers",
     "unknown key. Valid keys here: max_failures"),
    ("cluster:\n  resources:\n    gpu: 1\n", 3, "cluster.resources.gpu",
     "did you mean 'gpus'?"),
    ("runtime:\n  device: cpu\n  env_vars: {A: b}\n", 3, "runtime.env_vars",
     "Valid keys here: device, dist_backend, threads, timeout, env, working_dir"),
    # options that do not go together
    ("cluster:\n  engine: dask\n  launcher: mpi\n", 3, "cluster.launcher",
     "the dask engine has no 'mpi' launcher"),
    ("cluster:\n  launcher: kubernetes\n", 2, "cluster.launcher",
     "the ipyparallel engine has no 'kubernetes' launcher"),
    ("cluster:\n  launcher: slurm\n", 2, "cluster.launcher", "set `listen`"),
    ("runtime:\n  device: cpu\n  dist_backend: nccl\n", 3, "runtime.dist_backend",
     "needs --device cuda"),
    ("cluster:\n  launcher: ssh\n  listen: h\n  hosts: [a]\n  workers: 3\n", 5,
     "cluster.workers", "more than the 1"),
    # values out of range, checked by the record too
    ("cluster:\n  workers: 0\n", 2, "cluster.workers", "at least 1, got 0"),
    ("cluster:\n  resources:\n    cpus: 0\n", 3, "cluster.resources.cpus", "at least 1"),
    ("cluster:\n  resources: {gpus: -1}\n", 2, "cluster.resources.gpus", "at least 0"),
    ("cluster:\n  launcher: ssh\n  listen: h\n  hosts:\n    a: 0\n", 4, "cluster.hosts",
     "the workers on host 'a' must be at least 1"),
    ("runtime:\n  threads: 0\n", 2, "runtime.threads", "at least 1"),
    ("runtime:\n  timeout: 0\n", 2, "runtime.timeout", "must be positive"),
    ("training:\n  cell_timeout: -1\n", 2, "training.cell_timeout", "must be positive"),
    ("training:\n  elastic:\n    max_failures: -1\n", 3, "training.elastic.max_failures",
     "at least 0"),
])
def test_each_problem_points_at_its_line_and_key(tmp_path, text, line, key, message):
    err = problem(tmp_path, text)
    assert len(err.problems) == 1 and err.problems[0][:2] == (line, key)
    assert message in err.problems[0][2]


def test_dask_jobqueue_needs_listen_but_kubernetes_does_not(tmp_path):
    problem(tmp_path, "cluster: {engine: dask, launcher: pbs}\n")
    parse_profile("cluster: {engine: dask, launcher: kubernetes}\n")


# ------------------------------------------------------------------------------ round trip
def test_saved_options_load_back_equal(tmp_path):
    options, defaults = to_options(load_profile(EXAMPLES / "slurm.yaml"))
    text = dump_profile(from_options(options, defaults), "saved\nfrom a test")
    assert text.startswith("# saved\n# from a test\n")
    assert "null" not in text  # unset values are left out, not written as null
    again = parse_profile(text)
    assert to_options(again) == (options, defaults)


def test_profiles_from_records_and_back():
    assert to_options(Profile()) == (ClusterOptions(), CellDefaults())
    assert to_options(from_options(ClusterOptions(n=2), CellDefaults(output="all"))) == (
        ClusterOptions(n=2), CellDefaults(output="all"))


@pytest.mark.parametrize("text,key,message", [
    ("cluster:\n  listen: 0.0.0.0\n", "cluster.listen", "a local cluster listens on loopback"),
    ("cluster:\n  launcher: slurm\n  listen: '*'\n  hosts: [a]\n", "cluster.hosts",
     "`hosts` is for the ssh launcher"),
])
def test_settings_that_would_be_ignored_are_refused(tmp_path, text, key, message):
    err = problem(tmp_path, text)
    assert err.problems[0][1] == key and message in str(err)
