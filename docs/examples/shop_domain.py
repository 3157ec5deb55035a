"""A τ²-bench domain of one's own, in one file: a shop whose agent places orders.

    SEAL_TAU2_DOMAINS=docs/examples/shop_domain.py bash loop.sh tiny --set ENV=tau2:shop

A domain is what τ²-bench's own domains are (tau2/domains/*): a database (a pydantic `DB`), a
toolkit whose `@is_tool` methods act on it, the policy the agent is told to follow, and tasks
whose `evaluation_criteria` say which calls solve them and what the agent must tell the user.
Importing this file registers it in τ²'s registry under the name `shop`, with a train and a test
split; SEAL_TAU2_DOMAINS (comma-separated files or module names) is how the stages import it
(docs/environments.md). The tests play it (tests/test_tau2_env.py).
"""

from tau2.data_model.tasks import Task
from tau2.environment.db import DB
from tau2.environment.environment import Environment
from tau2.environment.toolkit import ToolKitBase, ToolType, is_tool
from tau2.registry import registry

POLICY = """You are a shop assistant. You can look up items and place orders for the customer.
Place an order only for an item that exists and for a quantity the stock holds; tell the customer
the order's total price. Do not place an order the customer did not ask for."""


class ShopDB(DB):
    items: dict[str, dict]  # item id -> {"name", "price", "stock"}
    orders: list[dict]  # {"item_id", "quantity", "total"}


class ShopTools(ToolKitBase):
    db: ShopDB

    @is_tool(ToolType.READ)
    def find_item(self, name: str) -> dict:
        """Find an item by its name.

        Args:
            name: The item's name, e.g. "mug".

        Returns:
            The item: its id, name, price and stock.
        """
        for item_id, item in self.db.items.items():
            if item["name"] == name:
                return {"item_id": item_id, **item}
        raise ValueError(f"Item {name} not found")

    @is_tool(ToolType.WRITE)
    def place_order(self, item_id: str, quantity: int) -> dict:
        """Order an item.

        Args:
            item_id: The item's id.
            quantity: How many to order (at least 1, at most the stock).

        Returns:
            The order, with its total price.
        """
        item = self.db.items.get(item_id)
        if item is None:
            raise ValueError(f"Item {item_id} not found")
        if not 1 <= quantity <= item["stock"]:
            raise ValueError(f"Invalid quantity {quantity}: the stock holds {item['stock']}")
        item["stock"] -= quantity
        order = {"item_id": item_id, "quantity": quantity, "total": quantity * item["price"]}
        self.db.orders.append(order)
        return order


def get_environment(db=None, solo_mode=False):
    db = db or ShopDB(items={"i1": {"name": "mug", "price": 12, "stock": 5},
                             "i2": {"name": "teapot", "price": 30, "stock": 1}}, orders=[])
    return Environment(domain_name="shop", policy=POLICY, tools=ShopTools(db))


def _task(task_id, request, actions, info=()):
    return Task.model_validate({
        "id": task_id,
        "user_scenario": {"instructions": {"domain": "shop", "reason_for_call": request,
                                           "known_info": "You are a customer of the shop.",
                                           "task_instructions": "Ask for the order; end when it is done."}},
        "evaluation_criteria": {"actions": [{"action_id": f"{task_id}_{k}", "name": name, "arguments": args}
                                            for k, (name, args) in enumerate(actions)],
                                "communicate_info": list(info),
                                "reward_basis": ["DB", "COMMUNICATE"] if info else ["DB"]},
    })


TASKS = [
    _task("two_mugs", "I want to order 2 mugs (item i1).", [("place_order", {"item_id": "i1", "quantity": 2})]),
    _task("one_teapot", "I want to order the teapot (item i2) and know what I pay.",
          [("place_order", {"item_id": "i2", "quantity": 1})], info=["30"]),
    _task("five_mugs", "I want to order 5 mugs (item i1).", [("place_order", {"item_id": "i1", "quantity": 5})]),
    _task("two_teapots", "I want 2 teapots (item i2), but only if you have both.", []),
]
SPLITS = {"train": ["two_mugs", "one_teapot"], "test": ["five_mugs", "two_teapots"]}


def get_tasks(task_split_name=None):
    if task_split_name is None:
        return list(TASKS)
    if task_split_name not in SPLITS:
        raise ValueError(f"Invalid task split name: {task_split_name}. Valid splits are: {list(SPLITS)}")
    return [t for t in TASKS if t.id in SPLITS[task_split_name]]


if "shop" not in registry.get_domains():
    registry.register_domain(get_environment, "shop")
    registry.register_tasks(get_tasks, "shop", get_task_splits=lambda: SPLITS)
