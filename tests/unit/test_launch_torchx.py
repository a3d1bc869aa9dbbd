"""`plandsl launch`: a plan as a TorchX job for Slurm or Kubernetes, held to TorchX's own dry run.

The golden files are what TorchX itself writes (its slurm scheduler's sbatch script, its kubernetes scheduler's
Volcano job) for a 2-node and a 1-node plan, with its random parts (a session id, the job name's suffix) fixed. TorchX is imported by one fixture, once per worker that runs this module (xdist group `torchx`)."""
from __future__ import annotations

import re
import shlex
import sys

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.runtime import submit
from plandsl.runtime.launch import LaunchOptions, rank_command, torchrun_args
from tests.conftest import ROOT, STDLIB

pytestmark = pytest.mark.xdist_group("torchx")  # one worker imports TorchX and the Kubernetes client (~1 s)

TWO_NODES = "stdlib_plans/examples/data_parallel.plan"  # GPT-2 medium, dp 16 on two DGX A100 nodes
ONE_NODE = "stdlib_plans/local/tp_sp.plan"               # tp 2 with sequence parallelism, 2 processes on one node
IMAGE = "registry.example.com/plandsl:latest"


@pytest.fixture(scope="module")
def torchx():
    """TorchX's runner, imported once; skipped, saying how to install it, where the `launch` extra is missing."""
    return pytest.importorskip("torchx.runner", reason="TorchX is not installed: pip install 'plandsl[launch]'")


@pytest.fixture(autouse=True)
def in_the_checkout(monkeypatch):
    """The plans are named as a user in the checkout names them (the golden files hold those paths)."""
    monkeypatch.chdir(ROOT)


@pytest.fixture
def no_slurm(torchx, monkeypatch, tmp_path):
    """A PATH without `sinfo` or `sbatch`: TorchX then assumes Slurm 24.05 (as off a cluster's login node), so
    the script is the same on every machine, and a submission finds no sbatch. The Kubernetes job's name takes
    `-random` for its random suffix (11 to 14 letters, which would move the YAML's line breaks)."""
    from torchx.schedulers import kubernetes_scheduler
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kubernetes_scheduler, "make_unique", lambda name, string_length=0: f"{name}-random")


def launch(*args: str):
    return CliRunner().invoke(main, ["launch", *args])


def normalized(text: str) -> str:
    """TorchX's session id (a random UUID in every node's environment) as `<session-id>`."""
    return re.sub(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<session-id>", text)


# ---- TorchX's own dry run: the scheduler's job ---------------------------------------------------------------
CASES = [("slurm", TWO_NODES, ()), ("slurm", ONE_NODE, ()),
         ("kubernetes", TWO_NODES, ("--image", IMAGE, "--cfg", "queue=default")),
         ("kubernetes", ONE_NODE, ("--image", IMAGE, "--cfg", "queue=default"))]


@pytest.mark.parametrize("scheduler, path, options", CASES, ids=[f"{s}-{p.split('/')[-1][:-5]}" for s, p, _ in CASES])
def test_the_dry_run_is_torchxs_job_for_the_plan(no_slurm, golden, scheduler, path, options):
    result = launch(path, "--scheduler", scheduler, "--dryrun", "--steps", "5", *options)
    assert result.exit_code == 0, result.output
    extension = "sh" if scheduler == "slurm" else "yaml"
    golden(f"launch/{scheduler}_{path.split('/')[-1][:-5]}.{extension}", normalized(result.stdout))


def _torchrun(command: str) -> list[str]:
    """The torchrun command a node runs (`bash -c '...'`), as words."""
    return shlex.split(command)


@pytest.mark.parametrize("path, nodes, nproc", [(TWO_NODES, 2, 8), (ONE_NODE, 1, 2)])
def test_the_volcano_job_has_a_task_per_node_each_running_plandsl_run_under_torchrun(no_slurm, path, nodes, nproc):
    """Read back from the YAML: one task per node of the mesh, a GPU per process, torchrun with the mesh's
    nodes and processes starting `plandsl.run` with the arguments `plandsl run` gives its own torchrun."""
    result = launch(path, "--scheduler", "kubernetes", "--dryrun", "--image", IMAGE, "--cfg", "queue=default",
                    "--steps", "5", "--metrics", "/shared/metrics.jsonl")
    assert result.exit_code == 0, result.output
    import yaml  # PyYAML: TorchX's own dependency
    job = yaml.safe_load(result.stdout)
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh/")
    tasks = job["spec"]["tasks"]
    assert len(tasks) == nodes
    plan = api.load_plan(path)
    for task in tasks:
        [container] = task["template"]["spec"]["containers"]
        assert container["image"] == IMAGE
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(nproc)
        words = _torchrun(container["command"][2])
        assert words[0] == "torchrun"
        assert words[words.index("--nnodes") + 1] == str(nodes)
        assert words[words.index("--nproc_per_node") + 1] == str(nproc)
        assert nodes * nproc == plan.mesh.size
        ranks = rank_command(path, None, {}, LaunchOptions(steps=5, metrics="/shared/metrics.jsonl"))
        assert words[words.index("-m"):] == ranks
        assert ranks == torchrun_args(plan, path, None, {}, LaunchOptions(
            steps=5, metrics="/shared/metrics.jsonl", nnodes=nodes, rdzv_endpoint="node0:29500"))[-len(ranks):]
        env = {item["name"]: item["value"] for item in container["env"]}
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == ("1" if plan.tp > 1 else None)
        assert env["OMP_NUM_THREADS"] == str(max(1, 2 // nproc))


def test_the_sbatch_script_starts_every_node_of_the_mesh(no_slurm):
    result = launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--cfg", "partition=gpu,time=60",
                    "--cfg", "account=ml", "--cpu", "96", "--mem-mb", "1000000", "--name", "gpt2-ddp")
    assert result.exit_code == 0, result.output
    script = result.stdout
    assert script.startswith("sbatch --parsable --account=ml $SBATCH_SCRIPT")
    groups = re.findall(r"^#SBATCH (--job-name=.*)$", script, re.M)
    assert len(groups) == 2 and "#SBATCH hetjob" in script
    for index, group in enumerate(groups):
        assert group.split()[:5] == [f"--job-name=gpt2-ddp-{index}", "--requeue", "--partition=gpu", "--time=60",
                                     "--ntasks-per-node=1"]
        assert "--cpus-per-task=96" in group and "--mem=1000000" in group and "--gpus-per-task=8" in group
    assert script.count("--nnodes 2 --nproc_per_node 8") == 2
    assert script.count(f"-m plandsl.run {TWO_NODES} --steps 10") == 2
    assert "OMP_NUM_THREADS=12" in script and "CUDA_DEVICE_MAX_CONNECTIONS" not in script


def test_ranks_on_the_cpu_ask_for_no_gpu_and_no_single_hardware_queue(no_slurm):
    result = launch(ONE_NODE, "--scheduler", "slurm", "--dryrun", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "gpus-per" not in result.stdout and "CUDA_DEVICE_MAX_CONNECTIONS" not in result.stdout
    assert f"-m plandsl.run {ONE_NODE} --steps 10 --device cpu" in result.stdout


# ---- the environment the plan needs (no TorchX) --------------------------------------------------------------
def _plan(tensor: str = "tensor = megatron over tp with sequence_parallel", data: str = "data = zero1 over dp",
          mesh: str = "[dp = 2, tp = 4]", extra: str = "") -> object:
    return api.loads(f"""import "clusters/dgx_a100"
plan p {{
  model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
  cluster = dgx_a100 x 1
  mesh    = {mesh}
  train   = {{ global_batch: 16, micro_batch: 1 }}
  {data}
  {tensor}
  {extra}
}}
""", path=str(ROOT / "p.plan")).plans[0]


@pytest.mark.parametrize("plan, cuda, expected", [
    (dict(), True, "1"),                                              # tensor parallel: Megatron-LM's rule
    (dict(tensor="", mesh="[dp = 2, cp = 4]", extra="context = allgather over cp"), True, "1"),  # context parallel
    (dict(data="data = zero3 over dp"), True, None),                  # FSDP wants several hardware queues
    (dict(tensor="", mesh="[dp = 8]"), True, None),                   # neither
    (dict(), False, None),                                            # the ranks on the CPU
])
def test_cuda_device_max_connections_is_set_where_megatron_lm_requires_it(plan, cuda, expected):
    env = submit.environment(_plan(**plan), cuda=cuda, cpu=64, nproc=8)
    assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == expected
    assert env["OMP_NUM_THREADS"] == "8"


# ---- bad input: diagnostics and errors, exit 1 (usage: 2), never a traceback --------------------------------
def _refused(result, code: int, *needles: str):
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_a_scheduler_option_torchx_does_not_know_is_e718_naming_the_nearest_one(no_slurm):
    result = launch(TWO_NODES, "--scheduler", "kubernetes", "--dryrun", "--image", IMAGE,
                    "--cfg", "queue=default,namespce=ml")
    _refused(result, 1, "error[E718]: --cfg queue=default,namespce=ml: TorchX's kubernetes scheduler: "
                        "Unknown run option `namespce`",
             "= hint: did you mean `namespace`? `torchx runopts kubernetes` lists the scheduler's options")
    assert f"{TWO_NODES}: error:" not in result.output


@pytest.mark.parametrize("scheduler, options, message", [
    ("kubernetes", ("--image", IMAGE), "error[E718]: TorchX's kubernetes scheduler: Required run option: queue"),
    ("kubernetes", ("--image", IMAGE), "= hint: give it: --cfg queue=VALUE; `torchx runopts kubernetes`"),
    ("kubernetes", ("--image", IMAGE, "--cfg", "queue=default,reserved_memmb=lots"),  # at the option, not the item
     "error[E718]: --cfg reserved_memmb=lots: TorchX's kubernetes scheduler takes int for reserved_memmb (invalid "
     "literal for int() with base 10: 'lots')\n  = hint: give reserved_memmb a value of type int; `torchx runopts"),
    ("slurm", ("--cfg", "partition"), "error[E718]: --cfg partition: TorchX's slurm scheduler"),
])
def test_scheduler_options_torchx_refuses_are_e718(no_slurm, scheduler, options, message):
    _refused(launch(TWO_NODES, "--scheduler", scheduler, "--dryrun", *options), 1, message)


def test_a_scheduler_torchx_does_not_have_is_e718_through_the_api(no_slurm):
    """The CLI offers slurm and kubernetes only (click's choice, exit 2); the API passed TorchX's
    UnknownSchedulerException through, a traceback for its caller."""
    plan = api.load_launchable(ONE_NODE)
    job = api.job_options(scheduler="ray", dryrun=True)
    with pytest.raises(api.PlanError) as refused:
        api.submit_job(api.cluster_job(plan, ONE_NODE, None, {}, api.launch_options(), job), job)
    [diagnostic] = refused.value.diagnostics
    assert diagnostic.code == "E718" and diagnostic.message.startswith("TorchX has no scheduler 'ray' (it has ")
    assert "slurm" in diagnostic.message and diagnostic.hint.startswith("plandsl launch submits to slurm or kubernetes")


@pytest.mark.parametrize("name", [
    "x\n#SBATCH --wrap=evil",  # a directive of its own in the sbatch script
    "my job $(id)",            # `#SBATCH --job-name=my job $(id)-0`: sbatch splits the line at spaces
    "a/b",                     # TorchX's experiment `a`, run `b`; each node's log in a folder `slurm-ID-a`
    ".hidden", "x" * 64,
])
def test_a_job_name_that_is_not_one_word_is_a_usage_error(no_slurm, name):
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--name", name), 2,
             "Invalid value for --name", "one word of letters, digits")


def test_a_job_name_of_one_word_is_the_jobs(no_slurm):
    result = launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--name", "gpt2-medium_v1.2")
    assert result.exit_code == 0 and "#SBATCH --job-name=gpt2-medium_v1.2-0 " in result.output, result.output


@pytest.mark.parametrize("scheduler, options, message", [
    # a newline in the image ended the line it is written on (k8s YAML quotes it; refused for both)
    ("kubernetes", ("--image", IMAGE + "\n", "--cfg", "queue=default"), "Invalid value for --image"),
    ("kubernetes", ("--image", IMAGE, "--cfg", "queue=default\tx"), "Invalid value for --cfg"),
])
def test_an_image_or_option_with_a_control_character_is_a_usage_error(no_slurm, scheduler, options, message):
    _refused(launch(TWO_NODES, "--scheduler", scheduler, "--dryrun", *options), 2, message, "control character")


def test_a_slurm_option_with_a_space_is_refused_where_torchx_writes_it_unquoted(no_slurm):
    """`partition=a --exclusive` was written `#SBATCH ... --partition=a --exclusive`: whole nodes asked for."""
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--cfg", "partition=a --exclusive"), 1,
             "error[E718]: --cfg partition=a --exclusive: partition's value 'a --exclusive' holds a space",
             "= hint: give partition one word")
    result = launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--cfg", "comment=two words")
    assert result.exit_code == 0 and "'--comment=two words'" in result.output, result.output  # an sbatch argument


@pytest.mark.parametrize("option, value", [("--cpu", "1" + "0" * 30), ("--cpu", "65537"),
                                           ("--mem-mb", "99999999999999999999")])
def test_node_sizes_past_any_machine_are_a_usage_error(no_slurm, option, value):
    """--cpu 10^30 went into the sbatch script as written (and OMP_NUM_THREADS=1.25e29 for each rank)."""
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", option, value), 2, f"Invalid value for '{option}'")


def test_a_plan_that_does_not_check_is_its_diagnostics(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text((STDLIB / "examples" / "data_parallel.plan").read_text().replace("global_batch: 512",
                                                                                     "global_batch: 500"))
    _refused(launch(str(bad), "--scheduler", "slurm", "--dryrun", "--include", str(STDLIB)), 1, "error[E501]")


def test_a_plan_plandsl_run_refuses_is_refused(tmp_path):
    plan = tmp_path / "chimera.plan"
    plan.write_text((STDLIB / "local" / "pp_1f1b.plan").read_text().replace("schedule = 1f1b",
                                                                             "schedule = chimera"))
    assert "chimera" in plan.read_text()
    _refused(launch(str(plan), "--scheduler", "slurm", "--dryrun", "--include", str(STDLIB / "local")), 1,
             "error[E701]")


def test_a_mesh_over_nodes_of_two_types_is_e707():
    _refused(launch("stdlib_plans/examples/heterogeneous.plan", "--scheduler", "slurm", "--dryrun"), 1,
             "error[E707]", "2 types (dgx_a100, dgx_h100)")


def test_rank_options_that_need_another_are_an_error():
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--resume"), 1,
             "error[E713]: --resume needs --checkpoint-dir", "= hint: give --checkpoint-dir D")


def test_kubernetes_without_an_image_is_a_usage_error():
    _refused(launch(TWO_NODES, "--scheduler", "kubernetes", "--dryrun", "--cfg", "queue=default"), 2,
             "Missing option '--image'")


def test_an_unknown_scheduler_is_a_usage_error():
    _refused(launch(TWO_NODES, "--scheduler", "ray", "--dryrun"), 2, "'ray' is not one of 'slurm', 'kubernetes'")


def test_a_submission_without_sbatch_is_e719_not_a_traceback(no_slurm):
    result = launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000")
    _refused(result, 1, "error[E719]: TorchX could not submit the job to slurm: ",
             "= hint: run it where `sbatch` runs, a login node of the Slurm cluster; --dryrun prints the job")
    assert f"{ONE_NODE}: error:" not in result.output and "TorchX warned: ;" not in result.output


def test_what_torchx_warned_of_before_a_failure_is_a_note_of_e719(no_slurm, monkeypatch):
    """What TorchX warned of on the way (often the cause: no kubeconfig) ended the message as `; TorchX warned:
    ...`; now each warning is a note of its own."""
    from torchx.runner.api import Runner

    def schedule(self, info):
        import warnings
        warnings.warn("no kubeconfig found")
        raise ConnectionRefusedError("connection refused")
    monkeypatch.setattr(Runner, "schedule", schedule)
    _refused(launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000"), 1,
             "error[E719]: TorchX could not submit the job to slurm: connection refused\n",
             "= note: TorchX warned: no kubeconfig found")


@pytest.mark.parametrize("failure", [lambda: __import__("subprocess").CalledProcessError(1, ["sbatch"]),
                                     lambda: FileNotFoundError(2, "No such file or directory", "sbatch"),
                                     lambda: __import__("urllib3").exceptions.MaxRetryError(None, "/apis", "refused"),
                                     lambda: __import__("kubernetes").client.exceptions.ApiException(403, "Forbidden")],
                         ids=["sbatch-fails", "no-sbatch", "unreached", "api-refuses"])
def test_the_schedulers_own_failure_to_take_the_job_is_e719(no_slurm, monkeypatch, failure):
    from torchx.runner.api import Runner

    def schedule(self, info):
        raise failure()
    monkeypatch.setattr(Runner, "schedule", schedule)
    _refused(launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000"), 1,
             "error[E719]: TorchX could not submit the job to slurm: ")


def test_sbatch_that_runs_and_refuses_the_job_is_e719_without_the_hint_to_find_sbatch(no_slurm, monkeypatch):
    """sbatch exiting 1 (an unknown partition: its message printed above) was E719 with the hint \"run it where
    `sbatch` runs, a login node\", where it did run: the hint says sbatch refused the job and what to mend."""
    import subprocess
    from torchx.runner.api import Runner

    def schedule(self, info):
        raise subprocess.CalledProcessError(1, ["sbatch", "--parsable", "torchx-sbatch.sh"])
    monkeypatch.setattr(Runner, "schedule", schedule)
    result = launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000", "--cfg", "partition=nosuch")
    _refused(result, 1, "error[E719]: TorchX could not submit the job to slurm: Command ",
             "= hint: sbatch ran here and refused the job (its own message is above): mend what it names")
    assert "a login node" not in result.output, result.output


def test_a_bug_as_the_job_is_submitted_is_e108_not_e719(no_slurm, monkeypatch):
    """runner.schedule's every exception was E719 ('run it where sbatch runs'), a plandsl (or TorchX) bug too: only
    the scheduler's own failures are E719, anything else the boundary's E108."""
    from torchx.runner.api import Runner

    def schedule(self, info):
        raise KeyError("request")
    monkeypatch.setattr(Runner, "schedule", schedule)
    result = launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000")
    _refused(result, 1, "error[E108]: internal error: KeyError: 'request'")
    assert "E719" not in result.output


def test_a_submission_needs_the_nodes_cpus_and_memory(no_slurm):
    _refused(launch(ONE_NODE, "--scheduler", "slurm"), 2, "--cpu and --mem-mb to submit")
    _refused(launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16"), 2, "--cpu and --mem-mb to submit")


def test_without_torchx_launch_says_how_to_install_it(monkeypatch):
    for name in [name for name in sys.modules if name == "torchx" or name.startswith("torchx.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchx", None)  # import torchx... raises ImportError
    result = launch(ONE_NODE, "--scheduler", "slurm", "--dryrun")
    _refused(result, 2, "error[E717]: plandsl launch needs TorchX and the Kubernetes client: ",
             "= hint: pip install 'plandsl[launch]'")
    assert not result.output.startswith("error: ")


def test_the_api_names_the_schedulers_of_the_launcher():
    assert api.launch_schedulers() == submit.SCHEDULERS


def test_the_api_builds_the_job_and_returns_torchxs_dry_run(no_slurm):
    plan = api.load_launchable(ONE_NODE)
    job = api.job_options(scheduler="slurm", dryrun=True)
    api.check_job_options(job)
    submitted = api.submit_job(api.cluster_job(plan, ONE_NODE, None, {}, api.launch_options(steps=3), job), job)
    assert submitted.handle is None and submitted.text.startswith("sbatch --parsable")
    assert f"--nnodes 1 --nproc_per_node 2 --tee 3 --role '\"'\"''\"'\"' -m plandsl.run {ONE_NODE} --steps 3" \
        in submitted.text
    mixed = "stdlib_plans/examples/heterogeneous.plan"
    assert [d.code for d in api.launch_refusals(api.load_plan(mixed))] == ["E707"]
    with pytest.raises(api.PlanError):
        api.load_launchable(mixed)
    assert issubclass(submit.TorchXMissing, submit.JobError) and issubclass(submit.JobError, ValueError)


def test_a_rack_scale_node_is_a_job_of_its_machines(torchx):
    """GB200 NVL72 racks (`hosts = 18` trays of 4 GPUs): TorchX's job asks for a machine per tray, 4 GPUs and 4
    processes each, not for a 72-GPU machine (tests/unit/test_launch.py's plan, two racks)."""
    from tests.unit.test_launch import NVL72
    plan = api.loads(NVL72).plans[0]
    application = submit.app(plan, "rack.plan", None, {}, LaunchOptions(), submit.JobOptions(scheduler="slurm"))
    [role] = application.roles
    assert role.num_replicas == 36 and role.resource.gpu == 4
    assert submit.refusals(plan) == []


def test_no_value_reaches_the_nodes_shell_through_torchxs_macros(no_slurm, tmp_path):
    """TorchX fills its macros (`${img_root}` the image on slurm without a workspace, `${app_id}`, `$$`) into the
    node's command after quoting it: an image holding a quote and an argument naming `${img_root}` ran
    `touch PWNED` on every node, and a plan file named `a${app_id}b$$c.plan` was another file there. The image is
    an image's characters; `$` in a forwarded argument is refused. The script of a plain launch, run by bash with
    srun and torchrun stubbed, touches nothing."""
    hostile = "x';touch " + str(tmp_path / "PWNED") + ";'"
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--image", hostile), 2, "Invalid value for --image")
    _refused(launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--image", IMAGE, "--metrics", "m${img_root}.json"),
             1, "error[E715]: 'm${img_root}.json': TorchX substitutes `$`")
    plan = tmp_path / "a${app_id}b$$c.plan"
    plan.write_text((STDLIB / "examples" / "data_parallel.plan").read_text())
    _refused(launch(str(plan), "--scheduler", "slurm", "--dryrun"), 1, "error[E715]: ", "TorchX substitutes `$`")
    assert launch(TWO_NODES, "--scheduler", "slurm", "--dryrun", "--image", "nvcr.io#nvidia/pytorch:24.05-py3").exit_code == 0


# ---- the job's check by the cluster (kubernetes' validate_spec) is the cluster's: E719; a bug is E108 -----------
def _api_server(monkeypatch, error: Exception):
    """Kubernetes' API server as `create_namespaced_custom_object` finds it: raising `error` (unreached, refusing)."""
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler

    class Api:
        def create_namespaced_custom_object(self, **kwargs):
            raise error
    monkeypatch.setattr(KubernetesScheduler, "_custom_objects_api", lambda self: Api())


def test_a_dry_run_asking_an_unreached_api_server_to_check_the_job_is_e719_not_a_bug(no_slurm, monkeypatch):
    """`--dryrun --cfg validate_spec=true` asks the API server to check the job: no server reached was E108 (a
    plandsl bug, 'please report it'), as TorchX's exception escaped the dry run."""
    _api_server(monkeypatch, ConnectionRefusedError(111, "Connection refused"))
    result = launch(TWO_NODES, "--scheduler", "kubernetes", "--dryrun", "--image", IMAGE,
                    "--cfg", "queue=default,validate_spec=true")
    _refused(result, 1, "error[E719]: TorchX could not check the job with kubernetes: [Errno 111] Connection refused",
             "= hint: check that the current kubeconfig")
    assert "E108" not in result.output


def test_a_job_the_api_server_refuses_is_e719_not_a_scheduler_option(no_slurm, monkeypatch):
    """TorchX turns the API server's refusal into `ValueError: Invalid job spec: ...`, which was E718 with a hint
    to `torchx runopts`: no option was wrong, the cluster refused the job."""
    from kubernetes.client.rest import ApiException
    _api_server(monkeypatch, ApiException(status=422, reason="Unprocessable Entity"))
    result = launch(TWO_NODES, "--scheduler", "kubernetes", "--image", IMAGE, "--cfg", "queue=default",
                    "--cpu", "16", "--mem-mb", "64000")
    _refused(result, 1, "error[E719]: TorchX could not check the job with kubernetes: Invalid job spec: "
                        "Unprocessable Entity")
    assert "E718" not in result.output and "torchx runopts" not in result.output


def test_a_bug_building_the_job_is_e108_submitted_or_not(no_slurm, monkeypatch):
    """An exception in TorchX's dry run of the job that asks no cluster (slurm's) is a bug in the job plandsl built,
    E108 with --dryrun; a submission made it E719, 'run it where sbatch runs', which would not have helped."""
    from torchx.schedulers.slurm_scheduler import SlurmScheduler

    def broken(self, app, cfg):
        raise TypeError("a bug")
    monkeypatch.setattr(SlurmScheduler, "_submit_dryrun", broken)
    for dryrun in (("--dryrun",), ()):
        result = launch(ONE_NODE, "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000", *dryrun)
        _refused(result, 1, "error[E108]: internal error: TypeError: a bug")
        assert "E719" not in result.output


def test_what_torchx_refuses_while_the_api_server_checks_the_job_is_still_e718(no_slurm, monkeypatch):
    """TorchX's own check on the way (a pod name past 63 characters), not the cluster's answer: E718 as before."""
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler

    class Api:
        def create_namespaced_custom_object(self, **kwargs):
            return {"metadata": {"name": "x"}}
    monkeypatch.setattr(KubernetesScheduler, "_custom_objects_api", lambda self: Api())
    result = launch(TWO_NODES, "--scheduler", "kubernetes", "--image", IMAGE, "--cfg", "queue=default",
                    "--cpu", "16", "--mem-mb", "64000", "--name", "a" * 60)
    _refused(result, 1, "error[E718]: TorchX's kubernetes scheduler: Pod name ")
