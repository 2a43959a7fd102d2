"""HTTP APIs of full mode: the §3.4 stage judge as a language model behind HTTP (Gemini or an
OpenAI-compatible server), `google_search` over a Serper-compatible web-search API, the HTTP client
both go through (the environment's proxy, rate limits, Retry-After, retries, disk cache), and the
judge's dated price table.

    settings.py       the run config's judge_http and search_http sections (HTTPJudgeConfig,
                      SearchHTTPConfig) and their checks: dataclasses, no connection
    pricing.py        USD per 1M tokens by model; the judge's cost plan of a run
    http.py           HTTPClient, DiskCache, APIStopError: the transport both backends share
    judge_prompts.py  the judge's prompts, reply schemas and validators
    judge_http.py     HTTPJudge: judge.EvolvingJudge's three hooks over HTTP
    search_http.py    SerperSearchTool: scaffold.SearchTool over HTTP

Who calls it: backends/run/build.py picks the judge and the search tool by configuration
(judge.backend, search.backend) and imports them only then; backends/run/presets.py registers the two
sections; backends/distributed/dry_run.py (key names, the cost plan), backends/sft/teacher.py and
backends/eval/ (evaluate.py's grader) use the rest. Imports nothing of the other packages.

Toy: a toy run imports settings.py and pricing.py (two dataclasses and a table) and nothing that
opens a connection; `requests` is imported only when a call is made.
"""
