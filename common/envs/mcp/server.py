"""One MCP server process and the SDK's client session on it (mcp.ClientSession over
mcp.client.stdio.stdio_client), driven from synchronous code through one event-loop thread.

Every request waits at most `timeout` seconds. A server that does not start, crashes, hangs or
writes outside the protocol raises ServerFault naming it and the tail of its stderr; a JSON-RPC
error answer is the tool's error result. close() ends the process (the SDK's shutdown: stdin
closed, then its process group terminated); servers still open at exit (Ctrl-C) are closed then.
"""

import atexit
import contextlib
import json
import logging
import os
import queue
import shlex
import sys
import tempfile
import threading

import anyio
import jsonschema
import mcp_types
from anyio.from_thread import BlockingPortal
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from common.engine import calls as C
from common.engine import session

START_S = 30.0  # seconds a server may take to start at least (a loaded machine starts Python slowly)


class ServerFault(RuntimeError):
    """The server failed the protocol (did not start, crashed, hung, wrote garbage): the
    environment's fault, not the agent's."""


logging.getLogger("mcp.client.stdio").setLevel(logging.CRITICAL)  # ServerFault says what went wrong
_loop = {"pid": None, "portal": None}
_lock = threading.Lock()
_open = set()  # servers not closed yet


def _portal():
    """The event loop every server's async client runs on: a daemon thread, one per process (a
    forked child, diagnose.py's workers, starts its own)."""
    with _lock:
        if _loop["pid"] != os.getpid():
            ready = queue.Queue()

            async def serve():
                async with BlockingPortal() as portal:
                    ready.put(portal)
                    await portal.sleep_until_stopped()
            threading.Thread(target=anyio.run, args=(serve,), name="mcp-client", daemon=True).start()
            _loop.update(pid=os.getpid(), portal=ready.get())
        return _loop["portal"]


def command_line(command):
    """argv of env.json's `command` (a list, or one string split as a shell would); `python` is
    this interpreter, so the server runs with the SDK the stages have."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    return [sys.executable if argv[0] in ("python", "python3") else argv[0], *argv[1:]]


def result_text(result):
    """A tools/call result as one string: its text blocks, other blocks by their type."""
    return "\n".join(b.text if b.type == "text" else f"[{b.type}]" for b in result.content)


class Server:
    """A fresh server process, its MCP session initialised and its tools listed:
    `tools` (OpenAI function dicts: name, description, parameters = the tool's inputSchema)."""

    def __init__(self, command, cwd, timeout):
        self.where = f"MCP server `{' '.join(command)}` in {cwd}"
        self.timeout, self.owner = timeout, os.getpid()
        self.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self.scopes, self.garbage, self.cm = set(), None, None
        portal = _portal()
        cm = portal.wrap_async_context_manager(self._connect(command_line(command), cwd))
        try:
            self.session, listed = cm.__enter__()
        except Exception as e:
            fault = self.fault("did not start", e)
            self.errlog.close()
            raise fault from None
        self.cm, self.portal = cm, portal
        _open.add(self)
        self.tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema}
                      for t in listed.tools]

    @contextlib.asynccontextmanager
    async def _connect(self, argv, cwd):
        params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=cwd)
        async with stdio_client(params, errlog=self.errlog) as (read, write), \
                ClientSession(read, write, message_handler=self._incoming) as session:
            listed = await self._bounded(self._start(session), "initialize and tools/list", max(self.timeout, START_S))
            yield session, listed

    async def _start(self, session):
        await session.initialize()
        return await session.list_tools()

    async def _incoming(self, message):
        """A line the transport could not read as JSON-RPC: fail what waits now, not at its timeout."""
        if isinstance(message, Exception):
            self.garbage = self.garbage or message
            for scope in self.scopes:
                scope.cancel()

    async def _bounded(self, coro, what, timeout=None):
        timeout = timeout or self.timeout
        with anyio.move_on_after(timeout) as scope:
            self.scopes.add(scope)
            try:
                return await coro
            except MCPError as e:
                if e.error.code == mcp_types.CONNECTION_CLOSED:
                    raise ServerFault(f"closed the connection during {what}") from None
                raise
            finally:
                self.scopes.discard(scope)
        if self.garbage:
            raise ServerFault(f"answered {what} outside the protocol ({' '.join(str(self.garbage).split())[:160]})")
        raise ServerFault(f"did not answer {what} within {timeout:g} s")

    async def _call(self, name, arguments):
        try:
            result = await self._bounded(self.session.call_tool(name, arguments), f"tools/call {name}")
        except MCPError as e:  # a JSON-RPC error answer: the protocol's way to refuse a call
            return e.error.message, True
        return result_text(result), bool(result.is_error)

    def call(self, name, arguments):
        """(text, is_error) of one tools/call; ServerFault when the server fails."""
        if self.cm is None:
            raise ServerFault(f"{self.where}: closed")
        try:
            return self.portal.call(self._call, name, arguments)
        except Exception as e:
            raise self.fault(f"failed on {name}", e) from None

    def fault(self, what, e):
        self.errlog.flush()
        self.errlog.seek(0)
        tail = [line.strip() for line in self.errlog.read()[-2000:].splitlines() if line.strip()][-2:]
        e = _leaf(e)
        reason = str(e) if isinstance(e, ServerFault) else f"{type(e).__name__}: {e}"
        return ServerFault(f"{self.where} {what}: {reason}" + (f" (stderr: {' | '.join(tail)[:300]})" if tail else ""))

    def close(self):
        cm, self.cm = self.cm, None
        _open.discard(self)
        if cm is not None and self.owner == os.getpid():
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
            self.errlog.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@atexit.register
def _close_all():
    for server in list(_open):
        server.close()


def _leaf(e):
    """The first exception inside (anyio's task groups wrap what leaves them)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def schema_error(call, tools):
    """Why `call` breaks the listed tools' inputSchemas, or None: common.engine.calls' reasons
    first (Ω's hints are chosen by them), then whatever else JSON Schema rules out."""
    reason = C.validate(call, tools)
    if reason:
        return reason
    schema = next(t["parameters"] for t in tools if t["name"] == call["name"])
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(call["arguments"]))
    return None if error is None else f"{call['name']}: {' '.join(error.message.split())[:160]}"


def run_call(server, tools, call):
    """(result, error) of one parsed call: a tool the server does not list is refused here, any
    other call goes to the server (a schema break too: the server has its own answer to it);
    an error result is shown as {"error": text}, which Ω's hint rules read as a failure."""
    if not any(t["name"] == call["name"] for t in tools):
        return json.dumps({"error": f"unknown tool {call['name'][:80]}"}), True
    text, error = server.call(call["name"], call["arguments"])
    return (json.dumps({"error": text}, ensure_ascii=False) if error else text), error


class Session(session.Session):
    """One episode's environment (common/engine/session.py): a fresh server for one task, its
    scripted user turns and the SDK's client for the calls. A server failure is the environment's,
    not the agent's: the step's remaining calls get an error result, `fault` names it, and the
    episode ends there (stop "server_error")."""

    def __init__(self, spec, task):
        super().__init__(task)
        self.system = spec["system"]
        try:
            self.server = Server(spec["command"], spec["dir"], spec["timeout"])
            self.tools = self.server.tools
        except ServerFault as e:
            self.server, self.tools, self.fault = None, [], str(e)

    def step(self, text, fmt):
        calls, parse_error = C.parse(text, fmt)
        ran = []
        for call in calls:
            if self.fault:
                ran.append((json.dumps({"error": "not run: the server failed"}), True))
                continue
            try:
                ran.append(run_call(self.server, self.tools, call))
            except ServerFault as e:
                self.fault = str(e)
                ran.append((json.dumps({"error": f"the server failed: {e}"}), True))
        return {"calls": calls, "parse_error": parse_error, "results": [r for r, _ in ran],
                "call_errors": [r if e else None for r, e in ran],
                "schema_errors": [schema_error(c, self.tools) for c in calls]}

    def close(self):
        if self.server is not None:
            self.server.close()
