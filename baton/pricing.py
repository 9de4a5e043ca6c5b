"""What a request costs: a price per model, in currency units per million tokens, for input
tokens, cached input tokens (what the engine reports as `prompt_tokens_details.
cached_tokens`) and output tokens. A model without a price costs 0, and the table says it has
none (`baton tenants usage` shows that rather than a misleading 0).

Money is an integer count of UNITS (10^-12 of a currency unit), and a price is kept as units
per token: a price of P per million tokens is P * 10^6 units a token, a whole number for any
price given to the micro-unit (6 decimals: $0.000001 per million tokens). Why integers:
a request's cost is then tokens * price exactly, with no rounding at all, and a period's spend
is a sum of integers, which does not drift however many millions of requests it adds up (a
float sum of costs like $0.0000375 does; `decimal` would be exact too, but it is slower on the
admission path and needs a context; Fraction is slower still). Python's integers do not
overflow; a store that keeps 64-bit integers holds up to about 9.2 million currency units per
row, so it should store spend as text or split it (see budgets.SpendRow)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

UNITS = 10**12  # units in one currency unit
PER_MILLION = 10**6  # a price per million tokens, in units, is this many units per token
DECIMALS = 6  # prices and budgets are given to the micro-unit (to a millionth)
_UNITS_PER_MICRO = 10**6  # UNITS / 10**DECIMALS
MAX_AMOUNT = 10**12  # no price or budget is larger: a bigger number is a typing mistake
PRICE_FIELDS = ("input", "cached_input", "output")


def units(value: object, what: str) -> int:
    """An amount of money an operator wrote (a number, or a string such as "0.15"), in units.
    Floats go through their shortest decimal form, so 0.15 is exactly 0.15. A ValueError names
    `what` for anything that is not a finite, non-negative amount given to the micro-unit."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"{what} must be a number, not {value!r}")
    try:
        given = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"{what} must be a number, not {value!r}") from None
    if not given.is_finite():
        raise ValueError(f"{what} must be finite, not {value!r}")
    if given < 0:
        raise ValueError(f"{what} must not be negative ({value!r})")
    if given > MAX_AMOUNT:
        raise ValueError(f"{what} must be at most {MAX_AMOUNT:,} ({value!r})")
    micro = given.scaleb(DECIMALS)  # exact: a shift of the exponent, no rounding
    if micro != micro.to_integral_value():
        raise ValueError(f"{what} has more than {DECIMALS} decimals ({value!r})")
    return int(micro) * _UNITS_PER_MICRO


def amount(value_units: int) -> Decimal:
    """Units as a currency amount (exact)."""
    return Decimal(value_units) / UNITS


def money(value_units: int) -> str:
    """Units as an operator reads them: at least 2 decimals, more only where they are not 0
    ("50.00", "0.000150")."""
    text = f"{amount(value_units):.{12}f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


@dataclass(frozen=True, slots=True)
class Price:
    """A model's price in units per token, which is the same number as micro-units per
    million tokens: 3.00 per million tokens is 3_000_000 units a token."""

    input: int
    cached_input: int
    output: int

    def __post_init__(self) -> None:
        for name in PRICE_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer of units, not {v!r}")

    @classmethod
    def per_million(cls, input: object, output: object, cached_input: object = None) -> Price:
        """From prices per million tokens as an operator writes them. Cached input tokens
        cost what input tokens cost unless a cached price is given."""
        per_token = _per_token(input, "input")
        cached = per_token if cached_input is None else _per_token(cached_input, "cached_input")
        return cls(per_token, cached, _per_token(output, "output"))

    def per_million_tokens(self) -> dict[str, Decimal]:
        """The prices as they were written: per million tokens, in currency units."""
        return {name: amount(getattr(self, name) * PER_MILLION) for name in PRICE_FIELDS}

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Units for that usage. `cached_tokens` are part of `prompt_tokens` (OpenAI's usage
        counts them in both); counts from an engine are clamped to sense rather than refused
        (a bad report must not take the accounting down)."""
        if not 0 <= cached_tokens <= prompt_tokens or completion_tokens < 0:  # rare: no min/max
            prompt_tokens = max(prompt_tokens, 0)
            cached_tokens = min(max(cached_tokens, 0), prompt_tokens)
            completion_tokens = max(completion_tokens, 0)
        return ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                + completion_tokens * self.output)  # fmt: skip

    def estimate(self, prompt_tokens: int, max_tokens: int) -> int:
        """What a request may cost before the engine says: its prompt at the full input price
        (which part the engine has cached is not known yet) and its cap on output."""
        if prompt_tokens < 0 or max_tokens < 0:
            return self.estimate(max(prompt_tokens, 0), max(max_tokens, 0))
        return prompt_tokens * self.input + max_tokens * self.output


def _per_token(value: object, what: str) -> int:
    # Exact: units() keeps at most DECIMALS decimals, so PER_MILLION divides it.
    return units(value, what) // PER_MILLION


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Prices by model name (a LoRA adapter is priced under the name requests use for it)."""

    prices: Mapping[str, Price] = field(default_factory=dict)

    @classmethod
    def parse(cls, table: Mapping[str, object]) -> PriceTable:
        """From config: {model: {input = 3, output = 15, cached_input = 0.3}}, prices per
        million tokens. A ValueError names the model and the field at fault."""
        prices: dict[str, Price] = {}
        for model, spec in table.items():
            if not isinstance(model, str) or not model:
                raise ValueError(f"a price is for a model name, not {model!r}")
            if not isinstance(spec, Mapping):
                raise ValueError(f"price of {model!r} must be a table of input, output, "
                                 f"cached_input, not {spec!r}")  # fmt: skip
            unknown = sorted(set(spec) - set(PRICE_FIELDS))
            if unknown:
                raise ValueError(f"price of {model!r}: unknown field {unknown[0]!r} "
                                 f"(input, output, cached_input)")  # fmt: skip
            for need in ("input", "output"):
                if need not in spec:
                    raise ValueError(f"price of {model!r}: {need} is missing")
            try:
                prices[model] = Price.per_million(spec["input"], spec["output"],
                                                  spec.get("cached_input"))  # fmt: skip
            except ValueError as e:
                raise ValueError(f"price of {model!r}: {e}") from None
        return cls(prices)

    def price(self, model: str) -> Price | None:
        return self.prices.get(model)

    def priced(self, model: str) -> bool:
        return model in self.prices

    def cost(
        self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> int:
        """Units for that usage of `model`; 0 for a model without a price."""
        p = self.prices.get(model)
        return 0 if p is None else p.cost(prompt_tokens, cached_tokens, completion_tokens)

    def estimate(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        p = self.prices.get(model)
        return 0 if p is None else p.estimate(prompt_tokens, max_tokens)

    def with_price(self, model: str, price: Price | None) -> PriceTable:
        """The table with `model`'s price set (None: removed), for `baton prices set/unset`."""
        prices = dict(self.prices)
        if price is None:
            prices.pop(model, None)
        else:
            prices[model] = price
        return PriceTable(prices)
