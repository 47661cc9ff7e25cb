"""is_runtime_failure: the one place that tells the runtime's failures (the job lost a
rank, a world moved on) from the training code's own errors, which end an elastic job."""
from horolite.elastic.run import is_runtime_failure
from horolite.failure.links import LinkLost
from horolite.world.generations import LeftOut
from horolite.world.rendezvous import RendezvousTimeout
from horolite.world.sockets import Superseded


def test_a_world_that_moved_on_is_not_the_training_codes_error():
    fence = LinkLost("the connection to rank 2 (host h) closed: it left for the next "
                     "generation of the world", [2])
    for error in (fence, Superseded("newer"), LeftOut("w3 is not in generation 4"),
                  RendezvousTimeout("no plan")):
        assert is_runtime_failure(error), error


def test_the_training_codes_own_errors():
    for error in (ValueError("bad batch"), AttributeError("typo"), KeyError("x")):
        assert not is_runtime_failure(error), error
