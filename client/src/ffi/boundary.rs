//! The edge between C and Rust: the panic boundary every exported function runs in, the
//! calling thread's last error, and the only places raw pointers from C are read or
//! written.

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::result::netagg_result;
use crate::Error;

/// Why a C API call failed: its code and the detail `netagg_last_error_message` gives.
pub(crate) struct Failure {
    pub code: netagg_result,
    pub message: String,
}

impl Failure {
    pub fn new(code: netagg_result, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }

    pub fn null(argument: &str) -> Failure {
        Failure::new(netagg_result::NETAGG_NULL_ARGUMENT, format!("argument '{argument}' is NULL"))
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Failure {
        Failure { code: netagg_result::from(&error), message: error.to_string() }
    }
}

impl From<crate::ConfigError> for Failure {
    fn from(error: crate::ConfigError) -> Failure {
        Failure::from(Error::Config(error))
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<(netagg_result, String)>> = const { RefCell::new(None) };
}

/// The calling thread's last failure, if any.
///
/// `try_with`, here and in [`guard`]: at process exit, atexit handlers and C++ static
/// destructors run after this thread's thread-locals are gone, and `with` would panic
/// where nothing can catch it.
pub(crate) fn last_error() -> Option<(netagg_result, String)> {
    LAST_ERROR.try_with(|last| last.borrow().clone()).ok().flatten()
}

/// Runs an exported function's body: a panic becomes `NETAGG_PANIC` instead of unwinding
/// into C (undefined behaviour) or aborting the host process, and a failure is recorded
/// as the thread's last error.
pub(crate) fn guard(function: &str, body: impl FnOnce() -> Result<(), Failure>) -> netagg_result {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return netagg_result::NETAGG_OK,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            Failure::new(netagg_result::NETAGG_PANIC, format!("panic: {}", crate::panic_message(&*panic)))
        }
    };
    let code = failure.code;
    let message = format!("{function}: {}", failure.message);
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = Some((code, message)));
    code
}

/// Borrows the object a C caller passed.
///
/// # Safety
/// `pointer` is NULL or points to a live `T` for `'a`.
pub(crate) unsafe fn borrow<'a, T>(pointer: *const T, argument: &str) -> Result<&'a T, Failure> {
    // SAFETY: non-NULL pointers are live objects by the caller's contract.
    unsafe { pointer.as_ref() }.ok_or_else(|| Failure::null(argument))
}

/// Mutably borrows the object a C caller passed.
///
/// # Safety
/// `pointer` is NULL or points to a live `T` that nothing else uses for `'a`.
pub(crate) unsafe fn borrow_mut<'a, T>(pointer: *mut T, argument: &str) -> Result<&'a mut T, Failure> {
    // SAFETY: as in `borrow`, and the caller guarantees exclusive use.
    unsafe { pointer.as_mut() }.ok_or_else(|| Failure::null(argument))
}

/// Reads a NUL-terminated UTF-8 string a C caller passed.
///
/// # Safety
/// `pointer` is NULL or points to a NUL-terminated string that lives for `'a`.
pub(crate) unsafe fn borrow_str<'a>(pointer: *const c_char, argument: &str) -> Result<&'a str, Failure> {
    if pointer.is_null() {
        return Err(Failure::null(argument));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let text = unsafe { CStr::from_ptr(pointer) };
    text.to_str().map_err(|_| {
        Failure::new(netagg_result::NETAGG_INVALID_ARGUMENT, format!("argument '{argument}' is not UTF-8"))
    })
}

/// An output the C caller provided, checked before any work is done and written only
/// once the call has succeeded.
pub(crate) struct Output<T> {
    pointer: *mut T,
}

impl<T> Output<T> {
    /// # Safety
    /// `pointer` is NULL or valid for writing a `T` until [`Output::write`].
    pub unsafe fn new(pointer: *mut T, argument: &str) -> Result<Output<T>, Failure> {
        if pointer.is_null() {
            return Err(Failure::null(argument));
        }
        Ok(Output { pointer })
    }

    pub fn write(self, value: T) {
        // SAFETY: non-NULL and writable (`new`'s contract).
        unsafe { self.pointer.write(value) }
    }
}

/// A struct every byte of which is initialised: no padding, so that its bytes may be
/// copied out as they are.
///
/// # Safety
/// The type has no padding bytes (a `repr(C)` struct of `u64`s, say).
pub(crate) unsafe trait Plain: Copy {}

/// Where a struct the caller sized goes: the caller says how many bytes its `T` has, which
/// differ from this library's when the two were built from different headers.
pub(crate) struct SizedOutput<T> {
    pointer: *mut T,
    size: usize,
}

impl<T: Plain> SizedOutput<T> {
    /// # Safety
    /// `pointer` is NULL or valid for writing `size` bytes until [`SizedOutput::write`].
    pub unsafe fn new(pointer: *mut T, size: usize, argument: &str) -> Result<SizedOutput<T>, Failure> {
        if pointer.is_null() {
            return Err(Failure::null(argument));
        }
        Ok(SizedOutput { pointer, size })
    }

    /// Writes the first `size` bytes of `value`, and zeros past its end.
    pub fn write(self, value: T) {
        let ours = size_of::<T>().min(self.size);
        let bytes = self.pointer.cast::<u8>();
        // SAFETY: `size` bytes at the pointer are writable (`new`'s contract), `ours` of
        // them come from `value`, initialised throughout (`Plain`), and the rest are zeroed.
        unsafe {
            std::ptr::copy_nonoverlapping((&raw const value).cast::<u8>(), bytes, ours);
            std::ptr::write_bytes(bytes.add(ours), 0, self.size - ours);
        }
    }
}

/// Copies `text` and a terminating NUL into the caller's `buffer` of `capacity` bytes and
/// its length (without the NUL) into `*length`. If it does not fit, nothing is copied,
/// `*length` is set to the length needed and the call fails with
/// `NETAGG_BUFFER_TOO_SMALL`; `buffer` may be NULL when `capacity` is 0, to ask the size.
///
/// # Safety
/// `buffer` is NULL or writable for `capacity` bytes; `length` is NULL or writable.
pub(crate) unsafe fn write_text(
    text: &str,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract.
    let length = unsafe { Output::new(length, "length")? };
    if capacity < text.len() + 1 {
        length.write(text.len());
        return Err(Failure::new(
            netagg_result::NETAGG_BUFFER_TOO_SMALL,
            format!("{} bytes are needed (with the NUL), the buffer has {capacity}", text.len() + 1),
        ));
    }
    if buffer.is_null() {
        return Err(Failure::null("buffer"));
    }
    // SAFETY: `buffer` is writable for `capacity >= text.len() + 1` bytes and cannot
    // overlap `text`, which this library owns.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), text.len());
        buffer.add(text.len()).write(0);
    }
    length.write(text.len());
    Ok(())
}

/// Hands a new object to C; [`free_boxed`] takes it back.
pub(crate) fn into_raw<T>(value: T) -> *mut T {
    Box::into_raw(Box::new(value))
}

/// Frees an object made by [`into_raw`]; NULL is fine.
///
/// # Safety
/// `pointer` is NULL or came from `into_raw::<T>` and was not freed yet.
pub(crate) unsafe fn free_boxed<T>(pointer: *mut T) {
    if !pointer.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(pointer) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        let code = guard("netagg_test", || panic!("boom"));
        assert_eq!(code, netagg_result::NETAGG_PANIC);
        let (last, message) = last_error().unwrap();
        assert_eq!((last, message.as_str()), (netagg_result::NETAGG_PANIC, "netagg_test: panic: boom"));
        let code = guard("netagg_test", || Err(Failure::null("config")));
        assert_eq!(code, netagg_result::NETAGG_NULL_ARGUMENT);
        assert_eq!(last_error().unwrap().1, "netagg_test: argument 'config' is NULL");
    }

    #[test]
    fn text_is_written_only_when_it_fits() {
        let mut buffer = [b'x' as c_char; 6];
        let mut length = 0usize;
        // SAFETY: `buffer` holds the capacity passed, and a null buffer
        // comes with capacity 0, as write_text's contract asks.
        let result = unsafe { write_text("hello", buffer.as_mut_ptr(), 5, &mut length) };
        assert_eq!((result.err().map(|f| f.code), length), (Some(netagg_result::NETAGG_BUFFER_TOO_SMALL), 5));
        assert_eq!(buffer[0], b'x' as c_char);
        // SAFETY: as above.
        unsafe { write_text("hello", buffer.as_mut_ptr(), 6, &mut length) }.ok().unwrap();
        // SAFETY: write_text succeeded, so the buffer holds a NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_str().unwrap(), "hello");
        // SAFETY: as above.
        let result = unsafe { write_text("hello", std::ptr::null_mut(), 0, &mut length) };
        assert_eq!(result.err().map(|f| f.code), Some(netagg_result::NETAGG_BUFFER_TOO_SMALL));
    }
}
