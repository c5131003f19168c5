"""``faultbench practice``: exercises with one hidden fault, sessions, grading, agent tasks."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from faultbench.harness.atomic import check_output
from faultbench.harness.commands import MAX_JOBS, at_most, load_plugins, positive_float, positive_int, seed_arg
from faultbench.model.seams import SUBSYSTEMS


def arguments(parser: argparse.ArgumentParser) -> None:
    practice_sub = parser.add_subparsers(dest="practice_command", required=True)
    for name, text in (("new", "write a standalone broken copy with a colleague's report"),
                       ("export", "the same, and optionally a .tar.gz of it to hand over")):
        new = practice_sub.add_parser(name, help=text)
        new.add_argument("--dir", required=True)
        new.add_argument("--seed", type=seed_arg, help="chooses the hidden fault (default: random)")
        new.add_argument("--fault", help="this fault instead of a hidden choice (for interviewers)")
        new.add_argument("--subsystem", choices=SUBSYSTEMS)
        new.add_argument("--difficulty", choices=("easy", "medium", "hard"))
        new.add_argument("--candidate", help="the candidate's name, for history and the report")
        new.add_argument("--max-answers", type=positive_int, default=3, help="scored answers allowed (default 3)")
    practice_sub.choices["export"].add_argument("--archive", metavar="FILE.tar.gz")
    practice_sub.choices["export"].add_argument("--force", action="store_true", help="replace an existing archive")
    for name, text in (("hint", "the next staged hint"), ("check", "is the edited copy repaired? (exit 0/1/2)"),
                       ("reveal", "the diff, the explanation, the fix, the real bug"),
                       ("status", "time used and left, hints, answers, checks"),
                       ("stop", "end the session: hints, answers and checks close"),
                       ("report", "the session's markdown report, for the interviewer")):
        p = practice_sub.add_parser(name, help=text)
        p.add_argument("dir")
    practice_sub.choices["report"].add_argument("--out", metavar="FILE.md")
    practice_sub.choices["report"].add_argument("--force", action="store_true", help="replace an existing --out file")
    start = practice_sub.add_parser("start", help="start the clock with a time budget")
    start.add_argument("dir")
    start.add_argument("--minutes", type=positive_float, required=True)
    practice_sub.add_parser("history", help="every exercise's attempts, times, hints and reveals")
    tasks = practice_sub.add_parser("export-tasks", help="exercises as tasks for a coding agent, with a hidden grader")
    tasks.add_argument("dir")
    tasks.add_argument("--tasks", type=at_most(100), required=True, help="how many (distinct faults)")
    tasks.add_argument("--seed", type=seed_arg, help="which faults (default 0)")
    agent = practice_sub.add_parser("run-agent", help="run an agent command on exported tasks and grade it")
    agent.add_argument("dir")
    agent.add_argument("--command", required=True, help="a shell command run in each task's folder ({python}: this "
                                                        "interpreter)")
    agent.add_argument("--name", required=True, help="the agent's name (results under DIR/runs/NAME)")
    agent.add_argument("--pass-env", action="append", metavar="VAR", help="an environment variable the agent needs")
    agent.add_argument("--only", nargs="+", metavar="TASK", help="these tasks only")
    validate = practice_sub.add_parser("validate", help="which faults show a symptom and are offered "
                                                         "(results/practice_offer.md)")
    validate.add_argument("--only", nargs="+", metavar="ID",
                          help="these faults only, printed (the table is left as it is)")
    validate.add_argument("--jobs", type=at_most(MAX_JOBS), default=2, help="faults validated at once (default 2)")
    ans = practice_sub.add_parser("answer", help="grade a diagnosis")
    ans.add_argument("dir")
    ans.add_argument("--subsystem", required=True)
    ans.add_argument("--seam", help="the function: full (model.rope.apply_rope) or a unique short name")
    for name, text in (("rubric", "what a strong debugging answer covers for one fault"),
                       ("runsheet", "the interviewer's minute-by-minute sheet: hints, model answers, score bands")):
        sheet = practice_sub.add_parser(name, help=text)
        sheet.add_argument("dir", nargs="?", help="an exercise folder (its hidden fault's)")
        sheet.add_argument("--fault", help="a fault id instead of a folder")
    practice_sub.choices["runsheet"].add_argument("--minutes", type=positive_int, default=45,
                                                  help="the interview slot (default 45)")
    score = practice_sub.add_parser("score", help="the interviewer's rubric scores, 1-4 per dimension")
    score.add_argument("dir")
    score.add_argument("scores", nargs="+", metavar="DIMENSION=N",
                       help="reproduce= isolate= instrument= fix= prevent= example= (each 1-4)")
    for p in practice_sub.choices.values():
        p.add_argument("--plugin", action="append")
        p.add_argument("--keys", metavar="DIR", help="where answer keys live (default: practice/ of the cache folder, "
                                                    "the checkout's .cache/ in a clone)")


def _rubric_scores(pairs: list[str]) -> dict[str, int]:
    """``dimension=N`` words as a dict (ValueError naming the first malformed one)."""
    scores = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not value.isdigit():
            raise ValueError(f"{pair!r} is not DIMENSION=N (e.g. reproduce=3)")
        scores[name] = int(value)
    return scores


def run(args) -> int:
    from faultbench.harness import practice, practice_session
    from faultbench.harness.rubric import rubric

    torch.set_num_threads(1)
    load_plugins(args)
    cmd, keys = args.practice_command, getattr(args, "keys", None)
    if cmd in ("rubric", "runsheet"):
        if (args.fault is None) == (args.dir is None):
            raise ValueError(f"practice {cmd} takes an exercise folder or --fault ID (one of them)")
        key = practice.load_key(args.dir, keys)[0] if args.fault is None else {"fault": args.fault}
        if cmd == "rubric":
            print(rubric(key["fault"]), end="")
        else:
            from faultbench.harness.runsheet import runsheet

            print(runsheet(key["fault"], args.minutes, key.get("candidate")), end="")
    elif cmd in ("new", "export"):
        if args.fault == "":
            raise ValueError("--fault '' names no fault (leave it out for a hidden one)")
        if getattr(args, "archive", None) is not None:  # refused before the exercise and its key are written
            check_output(args.archive, "--archive", force=args.force)
        where = practice.new_exercise(args.dir, args.seed, args.fault, args.subsystem, args.difficulty, keys,
                                      candidate=args.candidate, max_answers=args.max_answers)
        if getattr(args, "archive", None):
            print(f"archive to hand over: {practice.export_archive(where, args.archive, keys)}")
        print(f"exercise written to {where}: it runs on its own (README.md, train.py, check.py); the answer key "
              f"stays in {practice.keys_dir(keys)}")
    elif cmd == "start":
        practice_session.start(args.dir, args.minutes, keys)
        print(f"session started: {args.minutes:g} minutes")
    elif cmd == "status":
        print(practice_session.status(args.dir, keys))
    elif cmd == "export-tasks":
        from faultbench.harness.agent_tasks import export_tasks

        index = export_tasks(args.dir, args.tasks, args.seed if args.seed is not None else 0)
        print(f"{len(index)} tasks written to {args.dir}/tasks (answer keys in {args.dir}/grader: keep them from "
              "the agent)")
    elif cmd == "run-agent":
        from faultbench.harness.agent_tasks import run_agent, summary

        passed = {}
        for name in args.pass_env or ():
            if name not in os.environ:
                raise ValueError(f"--pass-env {name}: not set in this environment")
            passed[name] = os.environ[name]
        s = summary(run_agent(args.dir, args.command, args.name, passed, args.only))
        print(f"{args.name}: subsystem {s['subsystem']:.2f}, function {s['function']:.2f}, repaired "
              f"{s['repaired']:.2f} over {s['tasks']} tasks: {args.dir}/runs/{args.name}/results.md")
    elif cmd == "validate":
        from faultbench.harness import offer_table
        from faultbench.harness.practice_offer import validate

        rows = validate(args.only, args.jobs)
        if args.only:  # a partial table never replaces the committed one
            print(offer_table.table(rows), end="")
        else:
            print(f"{sum(r['offered'] for r in rows)} of {len(rows)} faults offered: {offer_table.write(rows)}")
    elif cmd == "stop":
        practice.stop(args.dir, keys)
        print("session stopped: hints, answers and checks are closed; `report` and `reveal` still work")
    elif cmd == "score":
        practice_session.score(args.dir, _rubric_scores(args.scores), keys)
        mean = practice_session.summary(practice.load_key(args.dir, keys)[0], 0.0)["score"]
        print(f"scored: overall {mean:.2f} of 4 ({practice_session.band(mean)})")
    elif cmd == "history":
        print(practice_session.history_table(practice_session.history(keys)), end="")
    elif cmd == "report":
        if args.out is not None:
            check_output(args.out, "--out", force=args.force)
        text = practice_session.report(args.dir, keys)
        if args.out:
            from faultbench.harness.atomic import write_text

            write_text(args.out, text)
            print(f"session report written to {args.out}")
        else:
            print(text, end="")
    elif cmd == "hint":
        print(practice.hint(args.dir, keys))
    elif cmd == "answer":
        verdict = practice.answer(args.dir, args.subsystem, args.seam, keys)
        if not verdict["scored"]:
            print("recorded, not scored: the answer was revealed already")
        else:
            seam = "" if verdict["seam"] is None else f"; function: {verdict['seam']}"
            late = "; past the time budget" if verdict["late"] else ""
            print(f"subsystem: {verdict['subsystem']}{seam} (hints used: {verdict['hints_used']}; answers left: "
                  f"{verdict['left']}{late})")
    elif cmd == "check":
        result = practice.check(args.dir, keys)
        if not result["isolated"]:
            from faultbench.harness.sandbox import unavailable

            print(f"warning: the copy's code ran without the grading sandbox ({unavailable()}): it could have read "
                  "the answer keys", file=sys.stderr)
        if result["code"] == 2:
            print(result["problems"][0])
        else:
            print("not repaired yet:" if result["code"] else "repaired: the run now behaves like the reference")
            print("".join(f"  - {p}\n" for p in result["problems"]), end="")
        return result["code"]
    else:
        print(practice.reveal(args.dir, keys))
    return 0
