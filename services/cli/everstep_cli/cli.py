"""The `everstep` command line: demo, up, down, submit, status, list, logs, pause, resume, cancel, scale, serve,
model import."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

SERVICES = ("controller", "rollout", "trainer", "reward", "sandbox")


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="controller URL (default: $EVERSTEP_URL or http://127.0.0.1:8000)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everstep", description="RL for reasoning models: IcePop, C3PO++.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo job end to end on the shipped demo model (examples/demo-model), "
                                       "print a JSON summary")
    demo.add_argument("--spec", default="examples/demo.yaml",
                      help="job spec of the demo (its model is built there first if the folder has none)")
    demo.add_argument("--out", default="outputs/demo", help="folder for the plot, metrics and summary")
    demo.add_argument("--port", type=int, default=0, help="controller port (0: a free one)")
    demo.add_argument("--rebuild", action="store_true",
                      help="first build a fresh demo model into outputs/<the spec model's folder name> with the "
                           "build options recorded in that model's build.json (python -m everstep_tools.demo: "
                           "the dense demo model in 8 to 12 minutes on 2 cores, the MoE one in 15 to 20) and run "
                           "the job on it and its train.jsonl/eval.jsonl")

    up = sub.add_parser("up", help="start Redis and every service in the background")
    up.add_argument("--port", type=int, default=8000, help="controller REST port")
    up.add_argument("--host", default="127.0.0.1", help="controller bind address")
    up.add_argument("--launcher", choices=("shared", "local"), default="shared",
                    help="shared: one rollout engine and trainer for all jobs, one job at a time; local: each job "
                         "gets its own rollout and trainer processes, several jobs run at once")

    sub.add_parser("down", help="stop everything `everstep up` started")

    submit = sub.add_parser("submit", help="submit a job spec (YAML)")
    submit.add_argument("job_file")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the spec by its dotted path before submitting, the value read as "
                             "YAML (e.g. --set trainer.learning_rate=3e-4 --set sampling.stop='[\"</s>\"]'); "
                             "repeatable, applied in order. A field the spec does not have, or a value it refuses, "
                             "is an error naming it and nothing is submitted. A relative path value is taken "
                             "relative to the current directory")
    submit.add_argument("--follow", action="store_true", help="show progress until the job ends")
    _add_url(submit)

    status = sub.add_parser("status", help="list jobs, or summarize one: state, step, error, latest metrics, "
                                           "evaluations, checkpoints, latest weights (--json: its whole record)")
    status.add_argument("job", nargs="?")
    status.add_argument("--json", action="store_true", help="with JOB: print the job's record as JSON")
    _add_url(status)

    listing = sub.add_parser("list", help="list jobs, one line each: id, state, step/steps, name")
    _add_url(listing)

    logs = sub.add_parser("logs", help="a job's history, one line per step (reward, trained samples, trainer "
                                       "statistics) and per evaluation")
    logs.add_argument("job")
    logs.add_argument("--follow", action="store_true",
                      help="keep printing new steps until the job ends (exit 1 unless it SUCCEEDED)")
    _add_url(logs)

    samples = sub.add_parser("samples", help="a step's samples as the model wrote them: turns, tool calls and "
                                             "replies, rewards")
    samples.add_argument("job")
    samples.add_argument("--step", type=int, default=None, help="the training step (default: the latest)")
    samples.add_argument("--json", action="store_true", help="print the samples as JSON")
    _add_url(samples)

    for action, text in (("pause", "pause a job (it stops after its current step)"),
                         ("resume", "resume a paused job"), ("cancel", "cancel a job")):
        command = sub.add_parser(action, help=text)
        command.add_argument("job")
        _add_url(command)

    scale = sub.add_parser("scale", help="resize a running job's rollout pool: engines start (and take the current "
                                         "weights) or drain and stop between two iterations")
    scale.add_argument("job")
    scale.add_argument("--rollout", type=int, required=True, metavar="M", help="rollout engines of the pool (>= 1)")
    _add_url(scale)

    model = sub.add_parser("model", help="prepare a model for everstep")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    imported = model_sub.add_parser(
        "import", help="a GGUF file or a transformers directory as a plain Hugging Face directory (config.json, "
                       "model.safetensors, tokenizer files with the chat template, generation_config.json with "
                       "every EOS id); runs the tools package's `everstep_tools.model_import`")
    imported.add_argument("source", help="a .gguf file, or a directory transformers loads")
    imported.add_argument("--out", required=True, help="folder to write (new or empty)")
    imported.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                          help="dtype of the saved weights")
    exported = model_sub.add_parser(
        "export", help="a job's checkpoint as a directory transformers or peft load: the Hugging Face model, or "
                       "with trainer.lora the PEFT adapter directory (--merge: the base with the adapters merged in); "
                       "runs the tools package's `everstep_tools.model_export`")
    exported.add_argument("job", help="job id")
    exported.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the latest)")
    exported.add_argument("--out", required=True, help="folder to write (new or empty)")
    exported.add_argument("--merge", action="store_true",
                          help="LoRA: merge the adapters into the base model (a plain Hugging Face directory)")
    _add_url(exported)

    serve = sub.add_parser("serve", help="run one service in the foreground (for containers)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (REST, metrics; the sandbox's API)")
    serve.add_argument("--grpc-port", type=int, default=None)
    return parser


def checkpoint_path(job: dict, step: int | None) -> str:
    """The folder of the job record's checkpoint of `step` (None: the latest); ValueError naming --step or the job
    when there is none."""
    checkpoints = sorted(job.get("checkpoints") or [], key=lambda c: c["step"])
    if not checkpoints:
        raise ValueError(f"job {job['id']} has no checkpoint yet (spec.checkpoint sets when it saves one)")
    if step is None:
        chosen = checkpoints[-1]
    else:
        found = [c for c in checkpoints if c["step"] == step]
        if not found:
            raise ValueError(f"--step: job {job['id']} has no checkpoint of step {step} "
                             f"(it has steps {[c['step'] for c in checkpoints]})")
        chosen = found[0]
    if not Path(chosen["path"]).is_dir():
        raise ValueError(f"the checkpoint of step {chosen['step']} is not on this machine: {chosen['path']}")
    return str(chosen["path"])


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so `demo` still brings down the stack it started."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command != "serve":
        sys.exit(f"everstep {args.command}: unrecognized arguments: {' '.join(extra)}")
    try:
        _dispatch(args, extra)
    except KeyboardInterrupt:
        sys.exit(130)
    except (RuntimeError, ValueError, FileNotFoundError, TimeoutError) as e:
        sys.exit(f"everstep {args.command}: {e}")


def _dispatch(args: argparse.Namespace, extra: list[str]) -> None:
    if args.command == "serve":
        from everstep_cli.local_stack import require_services

        require_services([args.service])
        command = [sys.executable, "-m", f"everstep_{args.service}", "--host", args.host]
        if args.port is not None:
            command += ["--port", str(args.port)]
        if args.grpc_port is not None:
            command += ["--grpc-port", str(args.grpc_port)]
        os.execv(sys.executable, command + extra)
    if args.command == "model":
        # torch and transformers live in the tools' (and the trainer's) package; the controller never imports them
        import importlib.util

        if importlib.util.find_spec("everstep_tools") is None:
            raise RuntimeError(f"model {args.model_command} needs the tools package: "
                               "pip install -e services/trainer -e tools")
        if args.model_command == "export":
            from everstep_cli.rest_client import ControllerClient

            checkpoint = checkpoint_path(ControllerClient(args.url).job(args.job), args.step)
            os.execv(sys.executable, [sys.executable, "-m", "everstep_tools.model_export", checkpoint,
                                      "--out", args.out, *(["--merge"] if args.merge else [])])
        os.execv(sys.executable, [sys.executable, "-m", "everstep_tools.model_import", args.source,
                                  "--out", args.out, "--dtype", args.dtype])
    if args.command == "demo":
        from everstep_cli.demo import run_demo

        summary = run_demo(Path(args.spec), Path(args.out), port=args.port, rebuild=args.rebuild)
        print(json.dumps(summary))
        return
    if args.command in ("up", "down"):
        import logging

        from everstep_cli.local_stack import LocalStack

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        stack = LocalStack()
        if args.command == "up":
            state = stack.up(port=args.port, host=args.host, launcher=args.launcher)
            print(f"everstep is up: controller {state.controller_url}, redis {state.redis_url}")
            for p in state.processes:
                print(f"  {p.name:<10} pid {p.pid:<7} log {p.log_path}")
        else:
            stopped = stack.down()
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        return

    from everstep_cli.rest_client import ControllerClient

    if args.command == "submit":
        from everstep_cli.job_file import load_job_file

        spec = load_job_file(args.job_file, args.overrides)  # a bad override: refused before any call
    client = ControllerClient(args.url)
    if args.command == "submit":
        record = client.submit(spec)
        print(record["id"])
        if args.follow:
            from everstep_cli.follow import follow_job

            final = follow_job(client, record["id"])
            print(json.dumps({k: final[k] for k in ("id", "state", "step", "error", "evaluation")}))
            if final["state"] != "SUCCEEDED":
                sys.exit(1)
    elif args.command == "status" and args.job:
        record = client.job(args.job)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            from everstep_cli.job_summary import summary_lines

            print("\n".join(summary_lines(record)))
    elif args.command in ("status", "list"):
        for job in client.jobs():
            print(f"{job['id']}  {job['state']:<10} step {job['step']:>4}/{job['spec']['steps']:<4} {job['name']}")
    elif args.command == "logs":
        from everstep_cli.logs import print_logs

        final = print_logs(client, args.job, follow=args.follow)
        if args.follow and final["state"] != "SUCCEEDED":
            sys.exit(1)
    elif args.command == "samples":
        from everstep_cli.samples import format_samples

        rows = client.samples(args.job, args.step)
        print(json.dumps(rows, indent=2) if args.json else format_samples(rows), end="" if not args.json else "\n")
    elif args.command in ("pause", "resume", "cancel"):
        print(client.action(args.job, args.command)["state"])
    elif args.command == "scale":
        if args.rollout < 1:
            sys.exit("everstep scale: --rollout must be at least 1")
        job = client.scale(args.job, rollout=args.rollout)
        print(f"{job['id']}: {job['spec']['resources']['rollout']['replicas']} rollout engine(s) from the next "
              "iteration")


if __name__ == "__main__":
    main()
