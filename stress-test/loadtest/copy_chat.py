"""The `copy-chat` workload of `loadtest compare`: chats whose answers copy much of their prompt (rewrite a code
file with one name changed, quote a passage), where speculative decoding by prompt lookup pays.

Requests are greedy and end where the model ends them (no `ignore_eos`): with and without speculation the answers
are the same tokens, so both sides do the same work and output tokens/s compare directly.
"""

from __future__ import annotations

import random

# Small code files and passages written for this benchmark.
CODE = {
    "inventory.py": (
        "count_items",
        "tally_items",
        '''from dataclasses import dataclass


@dataclass
class Item:
    name: str
    quantity: int
    price: float


def count_items(items: list[Item]) -> int:
    """How many units the inventory holds in all."""
    total = 0
    for item in items:
        total += item.quantity
    return total


def inventory_value(items: list[Item]) -> float:
    value = 0.0
    for item in items:
        value += item.quantity * item.price
    return value


def restock(items: list[Item], name: str, amount: int) -> None:
    for item in items:
        if item.name == name:
            item.quantity += amount
            return
    items.append(Item(name, amount, 0.0))


def report(items: list[Item]) -> str:
    lines = [f"{item.name}: {item.quantity}" for item in items]
    lines.append(f"units: {count_items(items)}")
    return "\\n".join(lines)
''',
    ),
    "queue.js": (
        "pending",
        "waiting",
        """class TaskQueue {
  constructor(limit) {
    this.limit = limit;
    this.running = 0;
    this.pending = [];
  }

  push(task) {
    return new Promise((resolve, reject) => {
      this.pending.push({ task, resolve, reject });
      this.next();
    });
  }

  next() {
    if (this.running >= this.limit || this.pending.length === 0) {
      return;
    }
    const { task, resolve, reject } = this.pending.shift();
    this.running += 1;
    task()
      .then(resolve, reject)
      .finally(() => {
        this.running -= 1;
        this.next();
      });
  }

  size() {
    return this.pending.length + this.running;
  }
}

module.exports = { TaskQueue };
""",
    ),
    "grades.py": (
        "scores",
        "marks",
        """def average(scores):
    if not scores:
        return 0.0
    return sum(scores) / len(scores)


def letter(score):
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"


def summary(students):
    rows = []
    for name, scores in students.items():
        mean = average(scores)
        rows.append((name, round(mean, 1), letter(mean)))
    rows.sort(key=lambda row: row[1], reverse=True)
    return rows


if __name__ == "__main__":
    students = {"ada": [95, 88, 92], "bob": [72, 65, 80], "cy": [58, 61, 70]}
    for name, mean, grade in summary(students):
        print(f"{name:>6} {mean:>6} {grade}")
""",
    ),
}

PASSAGES = (
    "The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking in the cold "
    "wind, and a single lamp burned in the window of the harbour master's office. By six o'clock the first crews "
    "arrived, carrying nets and thermos flasks, talking in low voices about the weather and the price of fuel. "
    "Nobody noticed the small blue boat that had drifted in during the night, empty, with its oars neatly stowed "
    "and a folded letter tucked under the bench.",
    "A good recipe for bread needs only four things: flour, water, salt and yeast. Mix the flour and the salt, add "
    "the yeast dissolved in warm water, and knead the dough for ten minutes until it is smooth. Let it rise in a "
    "warm place for an hour, shape it into a loaf, and let it rise again. Bake it in a hot oven for about forty "
    "minutes, until the crust is brown and the loaf sounds hollow when you tap it underneath.",
)


def prompts() -> list[str]:
    """Every copy-heavy request of the workload: each code file with one name changed, each passage quoted."""
    out = [
        f"Rewrite this file with `{old}` renamed to `{new}` everywhere. Reply with the whole file only.\n\n"
        f"```\n{source}```"
        for old, new, source in CODE.values()
    ]
    out += [f"Repeat the following passage word for word, then nothing else.\n\n{passage}" for passage in PASSAGES]
    return out


def pick(n: int, seed: int) -> list[str]:
    """`n` requests drawn from `prompts()` (every one in turn, shuffled)."""
    every = prompts()
    order = [every[i % len(every)] for i in range(n)]
    random.Random(seed).shuffle(order)
    return order
