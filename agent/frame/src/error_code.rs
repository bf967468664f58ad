//! HTTP/2 error codes (RFC 9113 section 7), as RST_STREAM and GOAWAY carry them and as a
//! [`crate::FrameError`] maps to one. A code the RFC does not name is kept as it is.

use std::fmt;

/// An HTTP/2 error code (RFC 9113 section 7); unknown codes are kept as they are.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

impl ErrorCode {
    pub const NO_ERROR: Self = Self(0x0);
    pub const PROTOCOL_ERROR: Self = Self(0x1);
    pub const INTERNAL_ERROR: Self = Self(0x2);
    pub const FLOW_CONTROL_ERROR: Self = Self(0x3);
    pub const SETTINGS_TIMEOUT: Self = Self(0x4);
    pub const STREAM_CLOSED: Self = Self(0x5);
    pub const FRAME_SIZE_ERROR: Self = Self(0x6);
    pub const REFUSED_STREAM: Self = Self(0x7);
    pub const CANCEL: Self = Self(0x8);
    pub const COMPRESSION_ERROR: Self = Self(0x9);
    pub const CONNECT_ERROR: Self = Self(0xa);
    pub const ENHANCE_YOUR_CALM: Self = Self(0xb);
    pub const INADEQUATE_SECURITY: Self = Self(0xc);
    pub const HTTP_1_1_REQUIRED: Self = Self(0xd);

    fn name(self) -> Option<&'static str> {
        const NAMES: [&str; 14] = [
            "NO_ERROR",
            "PROTOCOL_ERROR",
            "INTERNAL_ERROR",
            "FLOW_CONTROL_ERROR",
            "SETTINGS_TIMEOUT",
            "STREAM_CLOSED",
            "FRAME_SIZE_ERROR",
            "REFUSED_STREAM",
            "CANCEL",
            "COMPRESSION_ERROR",
            "CONNECT_ERROR",
            "ENHANCE_YOUR_CALM",
            "INADEQUATE_SECURITY",
            "HTTP_1_1_REQUIRED",
        ];
        NAMES.get(self.0 as usize).copied()
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "ErrorCode({:#x})", self.0),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    #[test]
    fn known_codes_print_their_rfc_name_and_unknown_ones_their_value() {
        assert_eq!(ErrorCode::NO_ERROR.to_string(), "NO_ERROR");
        assert_eq!(
            format!("{:?}", ErrorCode::ENHANCE_YOUR_CALM),
            "ENHANCE_YOUR_CALM"
        );
        assert_eq!(
            ErrorCode::HTTP_1_1_REQUIRED.to_string(),
            "HTTP_1_1_REQUIRED"
        );
        assert_eq!(ErrorCode(0xe).to_string(), "ErrorCode(0xe)");
        assert_eq!(ErrorCode(0xdead).to_string(), "ErrorCode(0xdead)");
    }
}
