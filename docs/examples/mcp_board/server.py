"""A small stateful MCP server: a team's ticket board (docs/environments.md, MCP servers).

    bash loop.sh tiny --set ENV=mcp:docs/examples/mcp_board

env.json says how SEAL starts it (over stdio, in this folder) and that `board` is the read-only
state probe the checker compares after every turn; train.jsonl and test.jsonl hold the tasks.
Each episode gets a fresh process, so the state below starts the same in every episode.
"""

from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

Priority = Literal["low", "medium", "high"]
Status = Literal["todo", "doing", "done"]
TEAM = ["ana", "ben", "chen"]

server = MCPServer("ticket-board", log_level="WARNING")
tickets = [
    {"id": "T-1", "title": "Fix login page", "priority": "high", "status": "todo", "assignee": None},
    {"id": "T-2", "title": "Update API docs", "priority": "low", "status": "doing", "assignee": "ben"},
    {"id": "T-3", "title": "Renew SSL certificate", "priority": "medium", "status": "todo", "assignee": None},
]


def ticket(ticket_id):
    for t in tickets:
        if t["id"] == ticket_id:
            return t
    raise ToolError(f"ticket {ticket_id} not found")


@server.tool()
def list_team() -> list[str]:
    """The names of the team's members, who can be assigned tickets."""
    return TEAM


@server.tool()
def find_tickets(query: str) -> list[dict]:
    """Tickets whose title contains the query (case-insensitive), with their id, priority, status and assignee."""
    return [t for t in tickets if query.lower() in t["title"].lower()]


@server.tool()
def add_ticket(title: str, priority: Priority) -> dict:
    """Add a ticket to the board (status todo, unassigned); returns it with its new id."""
    if any(t["title"].lower() == title.lower() for t in tickets):
        raise ToolError(f"a ticket titled {title!r} already exists")
    tickets.append({"id": f"T-{len(tickets) + 1}", "title": title, "priority": priority, "status": "todo",
                    "assignee": None})
    return tickets[-1]


@server.tool()
def move_ticket(ticket_id: str, status: Status) -> str:
    """Move a ticket (by its id, e.g. T-1) to another status."""
    ticket(ticket_id)["status"] = status
    return f"{ticket_id} is now {status}"


@server.tool()
def assign_ticket(ticket_id: str, assignee: str) -> str:
    """Assign a ticket (by its id) to a member of the team (see list_team)."""
    if assignee not in TEAM:
        raise ToolError(f"invalid assignee {assignee!r}: not on the team")
    ticket(ticket_id)["assignee"] = assignee
    return f"{ticket_id} is assigned to {assignee}"


@server.tool()
def set_priority(ticket_id: str, priority: Priority) -> str:
    """Change a ticket's priority."""
    ticket(ticket_id)["priority"] = priority
    return f"{ticket_id} has priority {priority}"


@server.tool()
def board() -> dict:
    """Every ticket on the board (read-only)."""
    return {"tickets": tickets}


if __name__ == "__main__":
    server.run()
