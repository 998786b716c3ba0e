! melissa_init and melissa_send, which include/melissa_api.f90 declares, over
! the C functions of melissa/api.h (melissa_finalize binds to C directly).
! They are external procedures, not a module's, because Melissa's Fortran API
! is an include file of interfaces; they take ordinary Fortran strings (the
! hidden length a bind(C) interface would drop) and pass C strings on, to C
! entries named apart from them (melissa_init_f, melissa_send_f: a binding
! label is a global name, as an external procedure's is).
module melissa_api_c
  use, intrinsic :: iso_c_binding, only: c_char, c_double, c_int, c_null_char
  implicit none
  private
  public :: c_name, c_init, c_send, c_double, c_int

  interface
    subroutine c_init(field_name, local_vect_size, comm) bind(C, name="melissa_init_f")
      import :: c_char, c_int
      character(kind=c_char), intent(in) :: field_name(*)
      integer(c_int), intent(in) :: local_vect_size, comm
    end subroutine

    subroutine c_send(field_name, send_vect) bind(C, name="melissa_send_f")
      import :: c_char, c_double
      character(kind=c_char), intent(in) :: field_name(*)
      real(c_double), intent(in) :: send_vect(*)
    end subroutine
  end interface

contains

  ! A NUL-terminated copy without trailing blanks (melissa_dl's c_string); C reads a
  ! name // C_NULL_CHAR up to that NUL.
  pure function c_name(text) result(out)
    character(*), intent(in) :: text
    character(kind=c_char, len=len_trim(text) + 1) :: out
    out = trim(text) // c_null_char
  end function
end module melissa_api_c

subroutine melissa_init(field_name, local_vect_size, comm)
  use melissa_api_c, only: c_init, c_int, c_name
  implicit none
  character(len=*), intent(in) :: field_name
  integer, intent(in) :: local_vect_size, comm
  call c_init(c_name(field_name), int(local_vect_size, c_int), int(comm, c_int))
end subroutine melissa_init

subroutine melissa_send(field_name, send_vect)
  use melissa_api_c, only: c_double, c_name, c_send
  implicit none
  character(len=*), intent(in) :: field_name
  real(c_double), intent(in) :: send_vect(*)
  call c_send(c_name(field_name), send_vect)
end subroutine melissa_send
