"""`loom generate | chat | serve | bench | analyze`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from loom.bench.cli import register as register_bench
from loom.config import check_model_path
from loom.engine.arg_utils import add_engine_args, engine_args_from_namespace
from loom.quant.cli import register_quantize
from loom.router.cli import register as register_router
from loom.server.cli import register as register_serve


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling options (see docs/sampling.md)")
    g.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, reproducible (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1] (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _sampling_params(ns: argparse.Namespace):  # noqa: ANN202
    from loom.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=ns.max_tokens, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p, min_p=ns.min_p,
            repetition_penalty=ns.repetition_penalty, presence_penalty=ns.presence_penalty,
            frequency_penalty=ns.frequency_penalty, seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos,
        )
    except ValueError as exc:  # the request's seed is --sampling-seed here (--seed is the engine's)
        if str(exc).startswith("seed "):
            raise ValueError(f"--sampling-seed {str(exc).removeprefix('seed ')}") from exc
        raise


def _cmd_generate(ns: argparse.Namespace) -> int:
    if not ns.prompt:  # the engine refuses it, but only --raw reached it empty: the chat template wraps it in a turn
        raise ValueError("prompt must not be empty")
    params = _sampling_params(ns)  # bad values are refused before torch and the engine load
    args = engine_args_from_namespace(ns)
    from loom.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(args))
    prompt: str | list[int] = ns.prompt
    if not ns.raw and llm.tokenizer.chat_template:
        prompt = llm.engine.apply_chat_template([{"role": "user", "content": ns.prompt}])
    elif not ns.raw:
        logging.getLogger("loom.cli").info("the model has no chat template (a base model): the prompt goes in as plain text")
    last = None
    for last in llm.stream(prompt, params):
        sys.stdout.write(last.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:  # why it stopped, on stderr: a reply cut at --max-tokens reads like a finished one
        done = last.outputs[0]
        why = " (the --max-tokens limit)" if done.finish_reason == "length" else ""
        logging.getLogger("loom.cli").info("%d tokens, finish_reason %s%s", len(done.token_ids), done.finish_reason,
                                           why)
        if done.finish_reason == "error":  # the engine logged why; a script must not read this as an answer
            print("loom: error: the request failed inside the engine (its error is logged above)", file=sys.stderr)
            return 1
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)  # bad values are refused before torch and the engine load
    args = engine_args_from_namespace(ns)
    from loom.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(args))
    if not llm.tokenizer.chat_template:
        print(f"loom: error: model {llm.engine.model_name!r} has no chat template (a base model): use "
              "`loom generate` (its prompt goes in as plain text)", file=sys.stderr)
        return 2
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("loom chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        if re.fullmatch(r"/\w+", line.strip()):  # a mistyped command (/rest) is not sent to the model as a message
            print(f"loom chat: unknown command {line.strip()}; the commands are /reset and /exit (a message may start "
                  "with / when it holds a space)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:  # a turn the engine refuses (not valid Unicode, too long) loses that line, not the conversation
            prompt = llm.engine.apply_chat_template(messages)
        except ValueError as exc:
            messages.pop()
            print(f"loom chat: {exc}; the conversation goes on without that line", file=sys.stderr)
            continue
        reply = ""
        try:
            for out in llm.stream(prompt, params):
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                reply = out.outputs[0].text
        except ValueError as exc:  # refused before any token (the conversation outgrew --max-model-len, say)
            messages.pop()
            print(f"loom chat: {exc}; the conversation goes on without that line (/reset starts it afresh)",
                  file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _log_level(value: str) -> str:
    """A logging level name, any case (argparse type: a bad one is a usage error, not a traceback)."""
    if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return value.upper()


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error prints the error and where the options are listed, not the whole usage (some
    subcommands take over 50 options: the mistake scrolled out of sight). Subcommands get _Subcommand."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for its options)\n")


class _Subcommand(_Parser):
    """A subcommand's parser (`loom generate`, `loom bench latency`): it reports the arguments it does not know itself,
    naming its own --help. argparse hands them back to the top-level parser instead, whose error pointed
    `loom generate --bogus` at `loom --help`. (argparse parses a subcommand's arguments with its parser's
    parse_known_args; unknown arguments given before the subcommand stay the top-level parser's to report.)"""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        if not hasattr(ns, "_subcommand_prog"):  # the innermost subcommand returns first (`loom bench latency`)
            ns._subcommand_prog = self.prog
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loom", description="loom: LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO", type=_log_level,
                        help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)  # nested ones inherit it

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt (sent through the chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=_cmd_chat)

    register_serve(sub)
    register_router(sub)
    register_bench(sub)
    register_quantize(sub)
    return parser


def _flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> its long option, over every subcommand (e.g. speculative_model -> --speculative-model)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update(_flags_of(sub))
        else:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long:
                flags.setdefault(action.dest, long[0])
    return flags


def _name_flags(message: str, flags: dict[str, str]) -> str:
    """The engine's errors name its fields (speculative_model); on the command line, name the flags instead.
    Multi-word names are replaced as whole identifiers anywhere; a one-word name (temperature, seed) only as the
    subject of an error ("temperature must be >= 0", "port: ... is taken", "alpha applies to ..."): elsewhere
    one-word names read as prose."""
    message = re.sub(r"(?<![\w'.-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w'])",
                     lambda m: flags.get(m.group(1), m.group(1)), message)
    return re.sub(r"^([a-z][a-z0-9]*)(?= must be |: | applies to )", lambda m: flags.get(m.group(1), m.group(1)),
                  message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from loom.env import check_switches

        check_switches()
        if hasattr(ns, "tensor_parallel_size"):  # a command with engine options
            args = engine_args_from_namespace(ns)  # a bad one is refused here, before torch and the engine load
            if args.model is not None:
                check_model_path(args.model)  # so is a checkpoint path that is not there
            if _torchrun_rank() > 0:  # a worker rank: rank 0 runs the command
                from loom.executor.worker import serve_torchrun_rank

                serve_torchrun_rank(args.model_config(), args.cache_config(), args.parallel_config(),
                                    args.num_threads)
                return 0
        return ns.func(ns)
    except ValueError as exc:  # a value the command refused: reported as argparse reports a malformed one
        prog = getattr(ns, "_subcommand_prog", parser.prog)
        parser.exit(2, f"{prog}: error: {_name_flags(str(exc), _flags_of(parser))}\n"
                       f"(run '{prog} --help' for its options)\n")
    except FileNotFoundError as exc:  # a file or optional package the command needs (ShareGPT's, say)
        parser.exit(2, f"{getattr(ns, '_subcommand_prog', parser.prog)}: error: {exc}\n")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT (each command cleans up as it unwinds)
        print(f"{getattr(ns, '_subcommand_prog', parser.prog)}: interrupted", file=sys.stderr)
        return 130


def _torchrun_rank() -> int:
    """This process's rank under torchrun (its RANK variable), else 0."""
    from loom.env import launched_by_torchrun  # torch-free: a value error must not wait for torch

    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


if __name__ == "__main__":
    sys.exit(main())
