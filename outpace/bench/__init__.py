"""`outpace bench latency | throughput | serve`: benchmarks of an engine or of a running server,
as `vllm bench` has them. One module a subcommand (its flags: `add_arguments`, its run: `run`);
`offline.py` (the engine side of latency and throughput), `datasets.py` (prompts) and
`report.py` (percentiles, results, progress) are shared.

Nothing here imports torch or aiohttp until a benchmark runs: a bad flag is an error at once."""

from __future__ import annotations


def add_bench_command(sub) -> None:
    """`bench` and its subcommands on the CLI's subparsers `sub`."""
    from outpace.bench import latency, serve, throughput
    from outpace.entrypoints.cli import ArgumentParser, HelpFormatter
    help_ = "benchmarks: latency, throughput (offline engine), serve (a running server)"
    b = sub.add_parser("bench", help=help_, description=help_, formatter_class=HelpFormatter)
    bsub = b.add_subparsers(dest="bench_cmd", required=True, parser_class=ArgumentParser)
    for module in (latency, throughput, serve):
        p = bsub.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                            formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
