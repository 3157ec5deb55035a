"""What the episode engine (common/engine/episode.py) asks of one episode's environment.

An environment's `session(task)` opens one per episode. A subclass writes `step` and says which tools it
lists; the defaults fit tools listed from the start and user turns that are the task's `turns` (texts).
Standard library only: an environment's module may subclass it at import.
"""


class Session:
    tools = []  # the tools listed now (OpenAI function dicts)
    system = None  # the environment's own system prompt, shown before Ω's cues
    fault = None  # why the environment itself failed (a crashed server): the episode ends, stop "server_error"
    hint_rules = ()  # the environment's Ω hint rules (common/seal/interface.py)

    def __init__(self, task):
        self.task, self.n_turns = task, len(task["turns"])

    def start_turn(self, k):
        """The tools that come with turn k besides those listed (announced to the model)."""
        return []

    def user_messages(self, k):
        return [{"role": "user", "content": self.task["turns"][k]}]

    def step(self, text, fmt):
        """Run the model's output `text` (calls written as `fmt`): a dict of `calls`, `parse_error`, `results`
        (one per call), `call_errors` and `schema_errors` (one per call, None where it ran cleanly)."""
        raise NotImplementedError

    def close(self):
        """Free what the episode holds (its process, its state)."""
