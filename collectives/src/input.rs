//! What a collective reads: a buffer of its own, or its output buffer ([`InPlace`]).

/// A collective's input, its `send` argument: a buffer of its own (`&send`, converted by
/// `From`), or [`InPlace`], which reads the input from the output buffer and writes the result
/// over it (as `MPI_IN_PLACE` does). Each collective's documentation says what in place means
/// for it where the output is not simply the input's size (reduce-scatter, all-gather).
#[derive(Debug)]
pub enum Input<'a, B: ?Sized> {
    /// A buffer of its own, not the output buffer (the borrow rules keep the two apart).
    Buf(&'a B),
    /// The output buffer holds the input.
    InPlace,
}

/// Pass as a collective's `send` to run it in place: `comm.all_reduce(InPlace, &mut buf, op)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace;

impl<B: ?Sized> Clone for Input<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for Input<'_, B> {}

impl<'a, B: ?Sized> From<&'a B> for Input<'a, B> {
    fn from(buf: &'a B) -> Self {
        Input::Buf(buf)
    }
}

impl<B: ?Sized> From<InPlace> for Input<'_, B> {
    fn from(_: InPlace) -> Self {
        Input::InPlace
    }
}

impl<'a, T> From<&'a Vec<T>> for Input<'a, [T]> {
    fn from(buf: &'a Vec<T>) -> Self {
        Input::Buf(buf)
    }
}

impl<'a, T, const N: usize> From<&'a [T; N]> for Input<'a, [T]> {
    fn from(buf: &'a [T; N]) -> Self {
        Input::Buf(buf)
    }
}

/// A buffer held mutably is read like any other (the call borrows it, shared, for its length).
impl<'a, B: ?Sized> From<&'a mut B> for Input<'a, B> {
    fn from(buf: &'a mut B) -> Self {
        Input::Buf(buf)
    }
}

impl<'a, T> From<&'a mut Vec<T>> for Input<'a, [T]> {
    fn from(buf: &'a mut Vec<T>) -> Self {
        Input::Buf(buf)
    }
}
