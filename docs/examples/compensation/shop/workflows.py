from durable_agents.api import tool, tool_step, wait_for_signal, workflow

from shop.models import Booking


@tool(effectful=True, transactional=True, compensate="cancel_booking")
def book_room(guest: str, nights: int, *, idempotency_key: str) -> dict:
    """Book a room for a guest."""
    booking, _ = Booking.objects.get_or_create(
        idempotency_key=idempotency_key, defaults={"guest": guest, "nights": nights}
    )
    return {"booking": booking.pk}


@tool(effectful=True, transactional=True)
def cancel_booking(guest: str, nights: int, *, idempotency_key: str, ctx) -> dict:
    """Cancel the booking book_room made with these arguments (its compensation)."""
    booking = Booking.objects.select_for_update().get(idempotency_key=ctx.args["effect"])
    booking.cancelled_with = {"guest": guest, "nights": nights, "idempotency_key": idempotency_key}
    booking.save(update_fields=["cancelled_with"])
    return {"cancelled": booking.pk}


workflow(
    "hotel_stay",
    steps=[
        tool_step("book", book_room, args=lambda ctx: {"guest": ctx.input["guest"], "nights": ctx.input["nights"]}),
        wait_for_signal("check_in", signal="checked_in"),
    ],
)
