"""The TensorFlow steps the step benchmarks time: a training step (plain, or with its tape
wrapped) and the exchange alone (one grouped allreduce shaped like the step's gradients)."""
import tensorflow as tf


def step_functions(model, x, y, loss_fn, opt, hvd, exchange_name):
    """(step_fn(wrap): a tf.function step, its tape wrapped by `wrap` unless None;
    exchange: a tf.function grouped allreduce of zeros shaped like the gradients)."""
    def step_fn(wrap):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if wrap is not None:
                tape = wrap(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step

    grads_like = [tf.zeros_like(v) for v in model.trainable_variables]

    @tf.function
    def exchange():
        return hvd.grouped_allreduce(grads_like, name=exchange_name)[0]
    return step_fn, exchange
