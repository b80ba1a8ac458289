from durable_agents import api

from shop.models import Booking


def test_hotel_stay__cancelling_with_compensation_calls_cancel_booking_with_the_bookings_arguments(drive):
    run = api.start("hotel_stay", {"guest": "Ada", "nights": 2})
    run = drive(run.id)  # books the room, then waits for the check-in signal
    assert run.status == "waiting"

    api.cancel(run.id, "the guest withdrew", compensate=True)
    run = drive(run.id)  # the saga: cancel_booking undoes book_room

    assert run.status == "cancelled"
    booking = Booking.objects.get()
    assert booking.cancelled_with == {
        "guest": "Ada",  # the original call's arguments, as it received them
        "nights": 2,
        "idempotency_key": f"{booking.idempotency_key}:compensate",  # its own key: the original's + ":compensate"
    }
