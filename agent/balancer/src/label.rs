//! [`label_enum!`]: a fieldless enum that is a bounded set of metric label values. Each value
//! has one label, [`ALL`](crate::metrics::RotationReason::ALL) lists the values in declaration
//! order, and `index()` is a value's position in it (where its cell sits in an array of
//! counters), so a new variant cannot be left out of any of them.

/// Declares `enum $name { $Variant => "label", ... }` with `ALL`, `label()`, `index()` and
/// `Display` (the label).
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in label order.
            pub const ALL: [Self; [$(stringify!($variant)),+].len()] = [$(Self::$variant),+];

            /// The label value.
            #[must_use]
            pub const fn label(self) -> &'static str {
                match self {
                    $( Self::$variant => $label, )+
                }
            }

            /// The value's position in [`Self::ALL`].
            #[must_use]
            pub const fn index(self) -> usize {
                self as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.label())
            }
        }
    };
}

pub(crate) use label_enum;
